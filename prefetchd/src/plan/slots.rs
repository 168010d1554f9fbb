//! A fixed table of block slots: local memory's cache buffers and each
//! donor's slots are one each. Slots are free or hold a block; a victim is
//! the slot whose block has the largest value among at most `sample`
//! slots taken round-robin from a sweep position, so a very large table
//! costs bounded time per choice.

use super::{BlockId, Nanos};

pub struct SlotTable {
    slots: Vec<Option<BlockId>>,
    free: Vec<u32>,
    sweep: usize,
}

impl SlotTable {
    /// `n` free slots, handed out lowest first.
    pub fn new(n: u32) -> SlotTable {
        SlotTable {
            slots: vec![None; n as usize],
            free: (0..n).rev().collect(),
            sweep: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The block in slot `i`.
    pub fn get(&self, i: u32) -> Option<BlockId> {
        self.slots[i as usize]
    }

    /// A free slot, taken.
    pub fn take_free(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Puts `block` into slot `i` (a taken or vacated one).
    pub fn put(&mut self, i: u32, block: BlockId) {
        self.slots[i as usize] = Some(block);
    }

    /// Empties slot `i` for the caller to reuse at once.
    pub fn vacate(&mut self, i: u32) -> Option<BlockId> {
        self.slots[i as usize].take()
    }

    /// Empties slot `i` and frees it.
    pub fn release(&mut self, i: u32) -> Option<BlockId> {
        let b = self.slots[i as usize].take();
        self.free.push(i);
        b
    }

    /// The occupied slots and their blocks.
    pub fn occupied(&self) -> impl Iterator<Item = (u32, BlockId)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, b)| Some((i as u32, (*b)?)))
    }

    pub fn used(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Among at most `sample` slots from the sweep position, the occupied
    /// one whose block's value is largest (the first of equals); `value`
    /// None: not a candidate. Returns (value, slot, block).
    pub fn victim(
        &self,
        sample: usize,
        mut value: impl FnMut(BlockId) -> Option<Nanos>,
    ) -> Option<(Nanos, u32, BlockId)> {
        let n = self.slots.len();
        let mut best: Option<(Nanos, u32, BlockId)> = None;
        for k in 0..sample.min(n) {
            let i = (self.sweep + k) % n;
            let Some(block) = self.slots[i] else { continue };
            let Some(v) = value(block) else { continue };
            if best.is_none_or(|(b, _, _)| v > b) {
                best = Some((v, i as u32, block));
            }
        }
        best
    }

    /// Moves the sweep position `by` slots on.
    pub fn advance(&mut self, by: usize) {
        if !self.slots.is_empty() {
            self.sweep = (self.sweep + by.min(self.slots.len())) % self.slots.len();
        }
    }

    /// Moves the sweep position just past slot `i`.
    pub fn sweep_past(&mut self, i: u32) {
        self.sweep = (i as usize + 1) % self.slots.len().max(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(i: u64) -> BlockId {
        BlockId::new(0, i)
    }

    #[test]
    fn slots_are_taken_lowest_first_and_freed() {
        let mut t = SlotTable::new(3);
        assert_eq!((t.take_free(), t.take_free()), (Some(0), Some(1)));
        t.put(0, b(7));
        t.put(1, b(8));
        assert_eq!(t.used(), 2);
        assert_eq!(t.release(0), Some(b(7)));
        assert_eq!(t.take_free(), Some(0));
        assert_eq!(t.vacate(1), Some(b(8)));
        assert_eq!(t.take_free(), Some(2));
        assert_eq!(t.take_free(), None);
    }

    #[test]
    fn the_victim_is_the_largest_value_within_the_sample_from_the_sweep() {
        let mut t = SlotTable::new(4);
        for i in 0..4 {
            t.take_free();
            t.put(i, b(u64::from(i)));
        }
        let value = |blk: BlockId| (blk.index != 2).then_some(blk.index * 10);
        // Slot 2 is not a candidate; 3 is the largest.
        assert_eq!(t.victim(4, value), Some((30, 3, b(3))));
        // Two slots from the sweep (0): 0 and 1.
        assert_eq!(t.victim(2, value), Some((10, 1, b(1))));
        t.advance(2);
        assert_eq!(t.victim(2, value), Some((30, 3, b(3))));
        t.sweep_past(3);
        assert_eq!(t.victim(1, value), Some((0, 0, b(0))));
        assert_eq!(SlotTable::new(0).victim(8, value), None);
    }
}
