//! The map across restarts: journal replay, torn tails, compaction.

use std::fs::{self, OpenOptions};
use std::io::Write;

use super::record::{encode, Record};
use super::*;

/// Mirror mode, 16 extents of 1 MiB.
pub(super) fn layout() -> Layout {
    Layout {
        size: 16 << 20,
        extent: 1 << 20,
        mode: Redundancy::Mirror,
        log_units: 0,
    }
}

fn unit(d0: u16, s0: u32, d1: u16, s1: u32) -> Option<Unit> {
    Some(Unit {
        members: vec![
            Member {
                loc: Loc::Donor {
                    donor: d0,
                    slot: s0,
                },
                state: CopyState::Ok,
            },
            Member {
                loc: Loc::Donor {
                    donor: d1,
                    slot: s1,
                },
                state: CopyState::Ok,
            },
        ],
    })
}

fn get(m: &ExtentMap, u: u64) -> Option<Unit> {
    m.unit(u).read().unwrap().clone()
}

/// A fresh mirror map in its own directory, donors "a" (0) and "b" (1) known.
fn mirror_map() -> (tempfile::TempDir, ExtentMap) {
    let dir = tempfile::tempdir().unwrap();
    let m = reopen(&dir);
    m.donor_id("a").unwrap();
    m.donor_id("b").unwrap();
    (dir, m)
}

/// The mirror map in `dir` opened again, as after a restart.
fn reopen(dir: &tempfile::TempDir) -> ExtentMap {
    ExtentMap::open(dir.path(), layout()).unwrap()
}

/// A closed map whose journal ends with units 1 and 2; its journal's path.
fn two_unit_journal() -> (tempfile::TempDir, std::path::PathBuf) {
    let (dir, m) = mirror_map();
    m.commit(1, &unit(0, 1, 1, 1)).unwrap();
    m.commit(2, &unit(0, 2, 1, 2)).unwrap();
    drop(m);
    let jpath = dir.path().join(JOURNAL_FILE);
    (dir, jpath)
}

#[test]
fn journal_survives_reopen_and_rebuilds_slots() {
    let dir = tempfile::tempdir().unwrap();
    {
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        let a = m.donor_id("a").unwrap();
        let b = m.donor_id("b").unwrap();
        m.set_capacity(SlotOwner::Donor(a), 8);
        m.set_capacity(SlotOwner::Donor(b), 8);
        assert_eq!(
            m.alloc(SlotOwner::Donor(a)),
            Some((Loc::Donor { donor: a, slot: 1 }, false))
        );
        m.commit(3, &unit(a, 1, b, 5)).unwrap();
        m.set_donor_label(a, 77).unwrap();
    }
    let m = ExtentMap::open(dir.path(), layout()).unwrap();
    assert_eq!(get(&m, 3), unit(0, 1, 1, 5));
    assert_eq!(m.donor_label(0), 77);
    assert_eq!(m.donor_id("b").unwrap(), 1);
    m.set_capacity(SlotOwner::Donor(0), 8);
    // slot 0 is the label, slot 1 is taken by unit 3.
    assert_eq!(
        m.alloc(SlotOwner::Donor(0)).unwrap().0,
        Loc::Donor { donor: 0, slot: 2 }
    );
    assert_eq!(m.slot_usage(SlotOwner::Donor(1)).0, 1);
}

#[test]
fn torn_journal_tail_is_discarded() {
    let (dir, jpath) = two_unit_journal();
    let len = fs::metadata(&jpath).unwrap().len();
    // Tear the last record in half.
    OpenOptions::new()
        .write(true)
        .open(&jpath)
        .unwrap()
        .set_len(len - 7)
        .unwrap();
    let m = reopen(&dir);
    assert_eq!(get(&m, 1), unit(0, 1, 1, 1));
    assert_eq!(get(&m, 2), None);
    // The tail was cut, so new records follow the valid prefix.
    m.commit(4, &unit(1, 3, 0, 3)).unwrap();
    drop(m);
    let m = reopen(&dir);
    assert_eq!(get(&m, 4), unit(1, 3, 0, 3));
    assert_eq!(get(&m, 1), unit(0, 1, 1, 1));
}

#[test]
fn corrupt_record_in_the_middle_keeps_the_prefix() {
    let (dir, jpath) = two_unit_journal();
    let mut data = fs::read(&jpath).unwrap();
    let n = data.len();
    data[n - 3] ^= 0xff;
    fs::write(&jpath, &data).unwrap();
    let m = reopen(&dir);
    assert_eq!(get(&m, 1), unit(0, 1, 1, 1));
    assert_eq!(get(&m, 2), None);
}

#[test]
fn compaction_and_a_crash_between_snapshot_and_journal_reset() {
    let (dir, m) = mirror_map();
    m.commit(1, &unit(0, 1, 1, 1)).unwrap();
    m.compact(None).unwrap();
    m.commit(2, &unit(0, 2, 1, 2)).unwrap();
    m.commit(1, &None).unwrap();
    // Crash in the middle of the next compaction: the new snapshot is in
    // place, the old journal (already folded in) is not reset.
    let p = m.persist.lock_or_recover();
    m.write_snapshot(&p, None, &PageRanges::default(), p.generation + 1)
        .unwrap();
    drop(p);
    drop(m);
    let m = reopen(&dir);
    assert_eq!(get(&m, 1), None);
    assert_eq!(get(&m, 2), unit(0, 2, 1, 2));
    // After recovery new records land in a journal of the new generation.
    m.commit(5, &unit(1, 4, 0, 4)).unwrap();
    drop(m);
    let m = reopen(&dir);
    assert_eq!(get(&m, 5), unit(1, 4, 0, 4));
    assert_eq!(get(&m, 2), unit(0, 2, 1, 2));
}

/// Parity width 3, 1 MiB extents of 256 pages, 2 log units.
pub(crate) fn log_layout() -> Layout {
    Layout {
        size: 8 << 20,
        extent: 1 << 20,
        mode: Redundancy::Parity { width: 3 },
        log_units: 2,
    }
}

#[test]
fn a_log_row_outside_the_log_is_refused_at_its_offset() {
    let dir = tempfile::tempdir().unwrap();
    let l = log_layout();
    {
        let m = ExtentMap::open(dir.path(), l).unwrap();
        m.donor_id("a").unwrap();
        m.journal_log_rows(0, 0, 2, &[Some(1), None]).unwrap();
    }
    let jpath = dir.path().join(JOURNAL_FILE);
    let good = fs::metadata(&jpath).unwrap().len();
    let mut f = OpenOptions::new().append(true).open(&jpath).unwrap();
    f.write_all(&encode(&Record::LogRow {
        unit: 5,
        row: 0,
        pages: vec![1, 0],
    }))
    .unwrap();
    drop(f);
    let e = ExtentMap::open(dir.path(), l).err().unwrap().to_string();
    assert!(e.contains(&format!("corrupt record at byte {good}")), "{e}");
    assert!(e.contains("log unit 5"), "{e}");
}

#[test]
fn a_changed_parity_log_size_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    drop(ExtentMap::open(dir.path(), log_layout()).unwrap());
    let e = ExtentMap::open(
        dir.path(),
        Layout {
            log_units: 1,
            ..log_layout()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("parity_log"), "{e}");
}

#[test]
fn crash_after_journal_append_before_any_snapshot() {
    let (dir, m) = mirror_map();
    m.commit(7, &unit(1, 9, 0, 9)).unwrap();
    // Dropped without sync or compaction: the records are in the file.
    drop(m);
    let m = reopen(&dir);
    assert_eq!(get(&m, 7), unit(1, 9, 0, 9));
    assert!(!dir.path().join(SNAPSHOT_FILE).exists());
}

#[test]
fn rebuilding_copies_come_back_lost_and_free() {
    let (dir, m) = mirror_map();
    let mut u = unit(0, 1, 1, 1).unwrap();
    u.members[1].state = CopyState::Rebuilding;
    m.commit(0, &Some(u)).unwrap();
    drop(m);
    let m = reopen(&dir);
    assert_eq!(get(&m, 0).unwrap().members[1].state, CopyState::Lost);
    assert_eq!(m.slot_usage(SlotOwner::Donor(1)).0, 0);
}

/// A move cut short by a restart: the member is back where it came from
/// (which kept its data), its new slot free; a finished move stays; the
/// same after a compaction taken mid-move.
#[test]
fn a_move_cut_short_rolls_back_and_a_finished_one_stays() {
    let (dir, m) = mirror_map();
    let c = m.donor_id("c").unwrap();
    m.commit(0, &unit(0, 1, 1, 1)).unwrap();
    m.commit(1, &unit(0, 2, 1, 2)).unwrap();
    let moving = |u: &Option<Unit>, slot| {
        let mut u = u.clone().unwrap();
        u.members[0] = Member {
            loc: Loc::Donor { donor: c, slot },
            state: CopyState::Rebuilding,
        };
        Some(u)
    };
    // Unit 0's member 0 moves to c and the switch is journaled; unit 1's
    // is still being copied when the process dies.
    m.commit_move(
        0,
        &moving(&unit(0, 1, 1, 1), 1),
        0,
        Loc::Donor { donor: 0, slot: 1 },
    )
    .unwrap();
    let mut done = moving(&unit(0, 1, 1, 1), 1);
    done.as_mut().unwrap().members[0].state = CopyState::Ok;
    m.commit(0, &done).unwrap();
    m.commit_move(
        1,
        &moving(&unit(0, 2, 1, 2), 2),
        0,
        Loc::Donor { donor: 0, slot: 2 },
    )
    .unwrap();
    drop(m);
    let m = reopen(&dir);
    assert_eq!(get(&m, 0), done);
    assert_eq!(get(&m, 1), unit(0, 2, 1, 2));
    assert_eq!(m.slot_usage(SlotOwner::Donor(c)).0, 1);
    assert_eq!(m.slot_usage(SlotOwner::Donor(0)).0, 1);

    // Mid-move again, compacted: the snapshot carries the move.
    m.commit_move(
        1,
        &moving(&unit(0, 2, 1, 2), 3),
        0,
        Loc::Donor { donor: 0, slot: 2 },
    )
    .unwrap();
    m.compact(None).unwrap();
    drop(m);
    let m = reopen(&dir);
    assert_eq!(get(&m, 1), unit(0, 2, 1, 2));
    assert_eq!(m.slot_usage(SlotOwner::Donor(c)).0, 1);
}

#[test]
fn layout_change_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    ExtentMap::open(dir.path(), layout()).unwrap();
    let mut other = layout();
    other.extent = 2 << 20;
    let e = ExtentMap::open(dir.path(), other)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("extent_size") && e.contains("map.journal"),
        "{e}"
    );
}

#[test]
fn write_intents_survive_reopen_and_compaction_until_swept() {
    let dir = tempfile::tempdir().unwrap();
    {
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        m.mark_written(2).unwrap();
        m.mark_written(5).unwrap();
        m.mark_written(9).unwrap();
        m.clear_intent(5).unwrap();
        assert_eq!(m.open_intents(), vec![2, 9]);
    }
    let m = ExtentMap::open(dir.path(), layout()).unwrap();
    assert_eq!(m.open_intents(), vec![2, 9]);
    m.compact(None).unwrap();
    drop(m);
    // From the snapshot alone (the new journal is empty).
    let m = ExtentMap::open(dir.path(), layout()).unwrap();
    assert_eq!(m.open_intents(), vec![2, 9]);
    // A sweep closes the groups not written since the last one.
    m.mark_written(9).unwrap();
    m.sweep_intents().unwrap();
    assert_eq!(m.open_intents(), vec![9]);
    m.sweep_intents().unwrap();
    assert_eq!(m.open_intents(), Vec::<u64>::new());
    drop(m);
    let m = ExtentMap::open(dir.path(), layout()).unwrap();
    assert_eq!(m.open_intents(), Vec::<u64>::new());
}

#[test]
fn a_group_poisoned_mid_write_stays_open_until_resynced() {
    let (_dir, m) = mirror_map();
    m.mark_written(3).unwrap();
    m.mark_written(4).unwrap();
    // A request panics while it holds group 3's write lock.
    std::thread::scope(|s| {
        let _ = s
            .spawn(|| {
                let _g = m.unit(3).write().unwrap();
                panic!("a request panicked mid-write");
            })
            .join();
    });
    assert!(m.unit(3).is_poisoned());
    for _ in 0..2 {
        assert_eq!(m.sweep_intents().unwrap(), vec![3]);
    }
    // Group 4 closed as usual; group 3 is still open for the resync.
    assert_eq!(m.open_intents(), vec![3]);
}

#[test]
fn a_clean_stop_closes_every_intent_but_an_unsynced_groups() {
    let (_dir, m) = mirror_map();
    for g in [1, 3, 4] {
        m.mark_written(g).unwrap();
    }
    m.mark_unsynced(3);
    // Written just now: a sweep would keep 1 and 4 open a while longer.
    assert_eq!(m.close_all_intents().unwrap(), vec![3]);
    assert_eq!(m.open_intents(), vec![3]);
    assert!(m.is_unsynced(3) && !m.is_unsynced(1));
    // Sweeps hand it back for a resync until one succeeds.
    assert_eq!(m.sweep_intents().unwrap(), vec![3]);
    m.clear_intent(3).unwrap();
    assert!(!m.is_unsynced(3));
    assert_eq!(m.open_intents(), Vec::<u64>::new());
}

#[test]
fn parity_members_are_counted_per_donor_through_changes_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let l = log_layout();
    let on = |donors: [u16; 3]| {
        Some(Unit {
            members: donors
                .iter()
                .map(|&donor| Member {
                    loc: Loc::Donor { donor, slot: 0 },
                    state: CopyState::Ok,
                })
                .collect(),
        })
    };
    {
        let m = ExtentMap::open(dir.path(), l).unwrap();
        for name in ["a", "b", "c"] {
            m.donor_id(name).unwrap();
        }
        // Parity sits at position `unit % 3`: donors 0, 1 and 2 in turn.
        m.commit(0, &on([0, 1, 2])).unwrap();
        m.commit(1, &on([0, 1, 2])).unwrap();
        m.commit(2, &on([0, 1, 2])).unwrap();
        assert_eq!(m.parity_held(), vec![1, 1, 1]);
        // Unit 1's parity moves from donor 1 to donor 2; unit 2 is freed.
        m.commit(1, &on([0, 2, 1])).unwrap();
        m.commit(2, &None).unwrap();
        assert_eq!(m.parity_held(), vec![1, 0, 1]);
    }
    let m = ExtentMap::open(dir.path(), l).unwrap();
    assert_eq!(m.parity_held(), vec![1, 0, 1]);
}

fn member(state: MemberState, joined: netpager_membership::Joined, since: u64) -> MemberRecord {
    MemberRecord {
        joined,
        since_unix: since,
        state,
        config: format!(r#"{{"name":"x{since}","address":"127.0.0.9:1"}}"#),
    }
}

#[test]
fn the_journal_replays_joins_and_departures_through_compaction() {
    use netpager_membership::Joined;
    let (dir, m) = mirror_map();
    let c = m.donor_id("c").unwrap();
    m.set_donor_member(0, member(MemberState::Member, Joined::Attach, 1))
        .unwrap();
    m.set_donor_member(c, member(MemberState::Member, Joined::Added, 2))
        .unwrap();
    m.set_donor_member(1, member(MemberState::Leaving, Joined::Attach, 1))
        .unwrap();
    m.set_donor_label(c, 77).unwrap();
    drop(m);
    let m = reopen(&dir);
    let e = m.donor_entries();
    assert_eq!(e.len(), 3);
    assert_eq!(e[1].member.as_ref().unwrap().state, MemberState::Leaving);
    // A label change keeps the membership it was journaled with.
    assert_eq!(e[2].label, 77);
    assert_eq!(
        e[2].member,
        Some(member(MemberState::Member, Joined::Added, 2))
    );
    m.set_donor_member(1, member(MemberState::Gone, Joined::Attach, 3))
        .unwrap();
    m.compact(None).unwrap();
    drop(m);
    let e = reopen(&dir).donor_entries();
    assert_eq!(e[1].member.as_ref().unwrap().state, MemberState::Gone);
    assert_eq!(e[1].member.as_ref().unwrap().since_unix, 3);
    assert_eq!(e[0].member.as_ref().unwrap().joined, Joined::Attach);
}

#[test]
fn donor_records_from_before_membership_still_replay() {
    // The old record: type, id, label, name and nothing after.
    let mut old = Vec::new();
    record::frame_into(&mut old, |p| {
        p.push(2);
        p.extend_from_slice(&4u16.to_le_bytes());
        p.extend_from_slice(&9u128.to_le_bytes());
        p.extend_from_slice(&(3u16).to_le_bytes());
        p.extend_from_slice(b"old");
    });
    let r = record::parse_records(&old).0;
    assert_eq!(
        r,
        vec![Record::Donor {
            id: 4,
            entry: DonorEntry {
                name: "old".into(),
                label: 9,
                member: None
            }
        }]
    );
}

#[test]
fn unfound_pages_survive_a_restart_and_a_compaction() {
    let (dir, m) = mirror_map();
    assert!(!m.any_unfound());
    m.set_unfound(256, 256, true).unwrap();
    m.set_unfound(300, 4, false).unwrap();
    drop(m);
    let m = reopen(&dir);
    assert_eq!(m.first_unfound_in(0, 1000), Some(256));
    assert_eq!(m.first_unfound_in(300, 100), Some(304));
    assert_eq!(m.first_unfound_in(300, 4), None);
    assert_eq!(m.first_unfound_in(512, 100), None);
    assert_eq!(m.unfound().pages(), 252);
    m.compact(None).unwrap();
    assert_eq!(m.set_unfound(256, 44, false).unwrap(), 44);
    drop(m);
    let m = reopen(&dir);
    let ranges: Vec<_> = m.unfound().ranges().map(|r| (r.start, r.end)).collect();
    assert_eq!(ranges, [(304, 512)]);
    // Past the device's 4096 pages: the journal is corrupt there.
    m.set_unfound(4095, 2, true).unwrap();
    drop(m);
    let e = ExtentMap::open(dir.path(), layout())
        .err()
        .expect("refused");
    assert!(
        e.to_string().contains("past the device's 4096 pages"),
        "{e}"
    );
}

#[test]
fn starting_empty_keeps_the_donors_and_nothing_else() {
    let (dir, m) = mirror_map();
    m.set_donor_label(1, 77).unwrap();
    *m.unit(3).write().unwrap() = unit(0, 1, 1, 1);
    m.commit(3, &unit(0, 1, 1, 1)).unwrap();
    m.set_unfound(0, 256, true).unwrap();
    drop(m);
    ExtentMap::start_empty(dir.path(), layout()).unwrap();
    let m = reopen(&dir);
    assert_eq!(get(&m, 3), None);
    assert!(!m.any_unfound());
    let names: Vec<_> = m
        .donor_entries()
        .into_iter()
        .map(|d| (d.name, d.label))
        .collect();
    assert_eq!(names, [("a".to_string(), 0), ("b".to_string(), 0)]);
}
