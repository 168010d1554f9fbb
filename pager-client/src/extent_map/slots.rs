//! Which slots of each donor export (and of the fallback file) hold a
//! member, and which are free.

use netpager_util::LockExt;

use super::{ExtentMap, Loc};

/// Used slots of one export (or of the fallback file).
#[derive(Debug, Clone, Default)]
pub(super) struct SlotSet {
    bits: Vec<u64>,
    capacity: u32,
    used: u32,
    /// Slots below this are reserved (slot 0 of a donor export holds the
    /// donor label).
    reserved: u32,
    /// Every slot below `hint` is used.
    hint: u32,
    /// Slots from here up have not been written since the export (or file)
    /// was last cleared, so they read as zeros.
    clean_from: u32,
}

impl SlotSet {
    pub(super) fn new(reserved: u32) -> SlotSet {
        SlotSet {
            reserved,
            clean_from: u32::MAX,
            ..Default::default()
        }
    }

    fn is_used(&self, s: u32) -> bool {
        self.bits
            .get((s / 64) as usize)
            .is_some_and(|w| w & (1 << (s % 64)) != 0)
    }

    pub(super) fn mark(&mut self, s: u32) -> bool {
        let w = (s / 64) as usize;
        if self.bits.len() <= w {
            self.bits.resize(w + 1, 0);
        }
        if self.is_used(s) {
            return false;
        }
        self.bits[w] |= 1 << (s % 64);
        self.used += 1;
        true
    }

    fn free(&mut self, s: u32) {
        if self.is_used(s) {
            self.bits[(s / 64) as usize] &= !(1 << (s % 64));
            self.used -= 1;
            self.hint = self.hint.min(s);
        }
    }

    /// The lowest free slot, and whether it is known to read as zeros.
    fn alloc(&mut self) -> Option<(u32, bool)> {
        let start = self.hint.max(self.reserved);
        let s = (start..self.capacity).find(|&s| !self.is_used(s))?;
        self.mark(s);
        self.hint = s + 1;
        let clean = s >= self.clean_from;
        if clean {
            self.clean_from = s + 1;
        }
        Some((s, clean))
    }

    fn mark_free_clean(&mut self) {
        let top = (0..self.bits.len() as u32 * 64)
            .rev()
            .find(|&s| self.is_used(s))
            .map_or(0, |s| s + 1);
        self.clean_from = top.max(self.reserved);
    }

    fn available(&self) -> u32 {
        let in_range = (self.reserved..self.capacity)
            .filter(|&s| self.is_used(s))
            .count() as u32;
        self.capacity
            .saturating_sub(self.reserved)
            .saturating_sub(in_range)
    }

    fn clear(&mut self) {
        self.bits.clear();
        self.used = 0;
        self.hint = 0;
        self.clean_from = u32::MAX;
    }
}

pub(super) struct Slots {
    pub(super) donors: Vec<SlotSet>,
    pub(super) fallback: SlotSet,
}

/// Where to allocate a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotOwner {
    Donor(u16),
    Fallback,
}

impl ExtentMap {
    /// Sets how many extent slots donor `id`'s export (or, with `None`, the
    /// fallback file) has.
    pub fn set_capacity(&self, owner: SlotOwner, slots: u32) {
        let mut s = self.slots.lock_or_recover();
        match owner {
            SlotOwner::Donor(id) => s.donors[id as usize].capacity = slots,
            SlotOwner::Fallback => s.fallback.capacity = slots,
        }
    }

    /// Takes a free slot, or `None` when the export or file is full; the
    /// flag says whether the slot is known to read as zeros.
    pub fn alloc(&self, owner: SlotOwner) -> Option<(Loc, bool)> {
        let mut s = self.slots.lock_or_recover();
        match owner {
            SlotOwner::Donor(donor) => s.donors[donor as usize]
                .alloc()
                .map(|(slot, clean)| (Loc::Donor { donor, slot }, clean)),
            SlotOwner::Fallback => s
                .fallback
                .alloc()
                .map(|(slot, clean)| (Loc::Fallback { slot }, clean)),
        }
    }

    /// Declares every free slot of `owner` clean: its export (or file) was
    /// just cleared.
    pub fn mark_free_slots_clean(&self, owner: SlotOwner) {
        let mut s = self.slots.lock_or_recover();
        match owner {
            SlotOwner::Donor(id) => s.donors[id as usize].mark_free_clean(),
            SlotOwner::Fallback => s.fallback.mark_free_clean(),
        }
    }

    /// Returns a slot (its old contents must be zeroed or trimmed before
    /// partial reuse; the device zeroes at allocation).
    pub fn free(&self, loc: Loc) {
        let mut s = self.slots.lock_or_recover();
        match loc {
            Loc::Donor { donor, slot } => s.donors[donor as usize].free(slot),
            Loc::Fallback { slot } => s.fallback.free(slot),
        }
    }

    /// Takes back slot `loc` for a member that holds it again (a donor
    /// taken back with its data); false if it is in use meanwhile.
    pub fn reclaim(&self, loc: Loc) -> bool {
        let mut s = self.slots.lock_or_recover();
        match loc {
            Loc::Donor { donor, slot } => s.donors[donor as usize].mark(slot),
            Loc::Fallback { slot } => s.fallback.mark(slot),
        }
    }

    /// Forgets every slot of donor `id` (it died: all its members are Lost,
    /// and if it comes back it is a new donor); returns the slots it used.
    pub fn forget_donor_slots(&self, id: u16) -> Vec<u32> {
        let mut s = self.slots.lock_or_recover();
        let set = &mut s.donors[id as usize];
        let used = (0..set.bits.len() as u32 * 64)
            .filter(|&k| set.is_used(k))
            .collect();
        set.clear();
        used
    }

    /// Whether slot `loc` holds a member.
    pub fn in_use(&self, loc: Loc) -> bool {
        let s = self.slots.lock_or_recover();
        match loc {
            Loc::Donor { donor, slot } => s.donors[donor as usize].is_used(slot),
            Loc::Fallback { slot } => s.fallback.is_used(slot),
        }
    }

    /// Slots in use and slots still free.
    pub fn slot_usage(&self, owner: SlotOwner) -> (u32, u32) {
        let s = self.slots.lock_or_recover();
        let set = match owner {
            SlotOwner::Donor(id) => &s.donors[id as usize],
            SlotOwner::Fallback => &s.fallback,
        };
        (set.used, set.available())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::layout;
    use super::*;

    #[test]
    fn slots_fill_up_and_freed_slots_are_reused() {
        let dir = tempfile::tempdir().unwrap();
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        let a = m.donor_id("a").unwrap();
        m.set_capacity(SlotOwner::Donor(a), 3);
        m.mark_free_slots_clean(SlotOwner::Donor(a));
        let (s1, clean1) = m.alloc(SlotOwner::Donor(a)).unwrap();
        let (s2, clean2) = m.alloc(SlotOwner::Donor(a)).unwrap();
        assert!(clean1 && clean2);
        assert_eq!(m.alloc(SlotOwner::Donor(a)), None);
        m.free(s1);
        // A freed slot comes back dirty: it must be zeroed before partial use.
        assert_eq!(m.alloc(SlotOwner::Donor(a)), Some((s1, false)));
        assert_ne!(s1, s2);
        m.forget_donor_slots(a);
        assert_eq!(m.slot_usage(SlotOwner::Donor(a)), (0, 2));
        assert!(!m.alloc(SlotOwner::Donor(a)).unwrap().1);
    }
}
