//! The drivers, run in the kernel: what they hand on and what they leave.

use aya::programs::{TestRun as _, TestRunOptions};
use ratelimit_testbed::skip_unless_root;

use super::*;
use crate::kernel::v4_frame;

/// The drivers the population figures stand on, run once each in the kernel: whatever they
/// read of a store first, the frame they hand on carries the source they promise (the next
/// address, or the array's), and the tail call reached its target (`XDP_PASS`, not the
/// driver's own `XDP_ABORTED`); an array's addresses come in turn, each once.
#[test]
fn drivers_hand_on_the_promised_source_whatever_they_touch() {
    if skip_unless_root() {
        return;
    }
    let dir = super::TestPinDir::new("rlb-progs-test");
    let dir = &dir.0;
    let pass = load(
        "rlb_t_pass",
        &[insn(MOV64_IMM, 0, 0, 0, XDP_PASS), insn(EXIT, 0, 0, 0, 0)],
        dir,
    )
    .unwrap();
    let array = prog_array(&pass).unwrap();
    // A store of 4 pages of 64-byte records, every byte 0xff: a driver that let what it read
    // into the source would hand on another one.
    let store = create_map(MAP_ARRAY, 4, 64, 4 * 64, F_MMAPABLE).unwrap();
    write_mapped(&store, &[0xff; 4 * 64 * 64]).unwrap();
    let paged = PagedStore::filled(4 * 64, Some(0xff)).unwrap();
    let (wide, narrow) = (
        LayoutStore::new(4 * 64, 8).unwrap(),
        LayoutStore::new(4 * 64, 7).unwrap(),
    );
    for s in [&wide, &narrow] {
        let n = s.groups * TAG_LINE_RECORDS * s.record_words;
        for i in 0..n {
            update_elem(s.words.as_fd(), i, &u64::MAX).unwrap();
        }
    }
    let (addrs, n) = turn_array(&[[10, 1, 2, 3]]).unwrap();
    let (warm, warm_n) = turn_array_warm(&[([10, 1, 2, 3], [4, 3 * 64 + 8])]).unwrap();
    // One run of a driver on `input`: its return value and the frame it hands on.
    let input = v4_frame([10, 0, 0, 255]);
    let run = |prog: &Xdp| -> (i32, Vec<u8>) {
        let mut out = vec![0u8; input.len()];
        let res = prog
            .test_run(TestRunOptions {
                data_in: Some(&input),
                data_out: Some(&mut out),
                ..TestRunOptions::new()
            })
            .unwrap();
        (res.return_value.cast_signed(), out)
    };
    let src_of = |f: &[u8]| -> [u8; 4] {
        let at = usize::try_from(IP_SRC).unwrap();
        f[at..at + 4].try_into().unwrap()
    };
    let touches = [
        None,
        Some(Touch::Record(store.as_fd(), 4 * 64)),
        Some(Touch::Candidates(store.as_fd(), 4 * 64)),
        Some(Touch::ChargedCandidates(store.as_fd(), 4 * 64)),
        Some(Touch::PagedRecord(paged.outer.as_fd(), paged.pages)),
        Some(Touch::PagedCandidates(paged.outer.as_fd(), paged.pages)),
        Some(wide.touch()),
        Some(narrow.touch()),
    ];
    for (i, touch) in touches.into_iter().enumerate() {
        for (sources, want) in [
            (Sources::Sequential, [10, 0, 1, 0]),
            (Sources::InTurn(addrs.as_fd(), n), [10, 1, 2, 3]),
            (
                Sources::InTurnWarm(warm.as_fd(), warm_n, store.as_fd()),
                [10, 1, 2, 3],
            ),
        ] {
            let insns = driver(sources, touch, array.as_fd());
            let prog = load(&format!("rlb_t_drv{i}"), &insns, dir).unwrap();
            let (ret, out) = run(&prog);
            assert_eq!(ret, XDP_PASS, "{touch:?} {sources:?}: the tail call");
            assert_eq!(src_of(&out), want, "{touch:?} {sources:?}: the source");
            assert_eq!(out[..IP_SRC as usize], input[..IP_SRC as usize]);
        }
    }
    // The charged touch's locked add is of zero: the store is as it was.
    assert!(
        read_mapped(&store, 4 * 64 * 64)
            .unwrap()
            .iter()
            .all(|&b| b == 0xff),
        "a touch changed the store"
    );
    // In turn: 10 runs over 5 addresses hand on each address once in the first 5 runs, then
    // the same order again (the cursor wraps).
    let five: Vec<[u8; 4]> = (1..=5).map(|i| [10, 9, 0, i]).collect();
    let (five_array, n) = turn_array(&five).unwrap();
    let insns = driver(Sources::InTurn(five_array.as_fd(), n), None, array.as_fd());
    let prog = load("rlb_t_turn", &insns, dir).unwrap();
    let sent: Vec<[u8; 4]> = (0..10)
        .map(|_| {
            let (ret, out) = run(&prog);
            assert_eq!(ret, XDP_PASS, "in turn: the tail call");
            src_of(&out)
        })
        .collect();
    let mut first = sent[..5].to_vec();
    assert_eq!(sent[5..], first[..], "the second turn repeats the first");
    first.sort_unstable();
    assert_eq!(first, five, "each address once a turn: {sent:?}");
}
