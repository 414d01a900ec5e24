//! The real XDP program flags the page of every bucket of a cluster-scoped limit it creates
//! (`RL_NEW_PAGES`), through BPF_PROG_TEST_RUN, so that the agent's cluster sync finds a new key
//! at its next round without walking the store: only those pages, each flag taken once, and a
//! known source's packet flags nothing. And it leaves a bucket of such a limit whose count just
//! passed a power of two in its grown slot, where a lighter record does not push it out.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use ratelimit::maps::{bucket::monotonic_coarse_ns, store::Slot, PinnedMaps};
use ratelimit_common::{grown_entry, grown_slot, BUCKET_PAGE_RECORDS};
use ratelimit_testbed::{
    packet::udp4,
    require_root,
    xdp::{make_cluster_scoped, XDP_PASS},
    TestDataplane,
};

/// The record holding `src`'s bucket of rule `rid`.
fn record(maps: &PinnedMaps, rid: u32, src: Ipv4Addr) -> u32 {
    let rule = maps.rule(rid).unwrap();
    let key = ratelimit::maps::bucket::bucket_key(rid, &rule, src.into());
    match maps.locate_bucket(&key, monotonic_coarse_ns()).unwrap().0 {
        Slot::Found(i) => i,
        _ => panic!("{src}: no bucket"),
    }
}

/// Runs `n` packets from `src` through the program: each passes.
fn passes(dp: &TestDataplane, src: Ipv4Addr, n: u32) {
    assert_eq!(
        dp.run_repeat(&udp4(src), n).0,
        XDP_PASS,
        "{n} packets from {src}"
    );
}

/// A test dataplane of `records` records with rule `c` (198.18.0.0/16, made cluster-scoped
/// here, as the agent does for `scope = "cluster"`) and rule `plain` (198.19.0.0/16), both at
/// `rate` packets a second and as large a burst: the dataplane, its maps and the two rules' ids.
fn two_rules(tag: &str, records: u32, rate: u32) -> (TestDataplane, PinnedMaps, u32, u32) {
    let mut dp = TestDataplane::new(tag, records).unwrap();
    let set = dp
        .install_toml(&format!(
            "[[rule]]\nname = \"c\"\nsource = \"198.18.0.0/16\"\nrate = {rate}\nburst = {rate}\n\n\
             [[rule]]\nname = \"plain\"\nsource = \"198.19.0.0/16\"\nrate = {rate}\nburst = {rate}\n",
        ))
        .unwrap();
    let (c, plain) = (
        set.by_name("c").unwrap().id,
        set.by_name("plain").unwrap().id,
    );
    let mut maps = PinnedMaps::open(dp.pin_dir()).unwrap();
    make_cluster_scoped(&mut maps, c).unwrap();
    (dp, maps, c, plain)
}

#[test]
fn new_buckets_of_cluster_limits_flag_their_pages_once_and_others_do_not() {
    require_root();
    // 64 pages of 64 records: one word of flags.
    let (dp, maps, c, plain) = two_rules("newpages", 4096, 1000);
    assert!(
        maps.new_pages().take().is_empty(),
        "flags before any packet"
    );

    // Sources of the plain rule: buckets created (at each one's second packet: the first
    // passes without one), no page flagged.
    let plains: Vec<Ipv4Addr> = (1..=40).map(|i| Ipv4Addr::new(198, 19, 1, i)).collect();
    for &s in &plains {
        assert_eq!(dp.run(&udp4(s)), XDP_PASS);
        assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    }
    for &s in &plains {
        let _ = record(&maps, plain, s);
    }
    assert!(
        maps.new_pages().take().is_empty(),
        "a plain rule's buckets flagged pages"
    );

    // Sources of the cluster-scoped rule: exactly the pages of their buckets.
    let clustered: Vec<Ipv4Addr> = (1..=40).map(|i| Ipv4Addr::new(198, 18, 1, i)).collect();
    for &s in &clustered {
        assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    }
    let want: BTreeSet<u32> = clustered
        .iter()
        .map(|&s| record(&maps, c, s) / BUCKET_PAGE_RECORDS * BUCKET_PAGE_RECORDS)
        .collect();
    let got: BTreeSet<u32> = maps.new_pages().take().into_iter().collect();
    eprintln!(
        "{} cluster buckets on {} pages",
        clustered.len(),
        want.len()
    );
    assert!(want.len() > 1, "the sources' buckets all on one page");
    assert_eq!(got, want);
    assert!(maps.new_pages().take().is_empty(), "a flag taken twice");

    // Their next packets find their buckets: nothing new, nothing flagged.
    for &s in &clustered {
        assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    }
    assert!(
        !maps.new_pages().any(),
        "a known source's packet flagged its page"
    );
    // A new one flags its page again.
    let late = Ipv4Addr::new(198, 18, 2, 1);
    assert_eq!(dp.run(&udp4(late)), XDP_PASS);
    let page = record(&maps, c, late) / BUCKET_PAGE_RECORDS * BUCKET_PAGE_RECORDS;
    assert_eq!(maps.new_pages().take(), vec![page]);
}

/// A pass over the flags stopped early goes on where it stopped, and the two parts take every
/// flagged page once.
#[test]
fn a_pass_over_the_flags_stopped_early_goes_on_where_it_stopped() {
    require_root();
    // 256 pages: four words of flags.
    let (dp, maps, c, _) = two_rules("newpages2", 16_384, 1000);
    let sources: Vec<Ipv4Addr> = (1..=200).map(|i| Ipv4Addr::new(198, 18, 1, i)).collect();
    for &s in &sources {
        assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    }
    let want: BTreeSet<u32> = sources
        .iter()
        .map(|&s| record(&maps, c, s) / BUCKET_PAGE_RECORDS * BUCKET_PAGE_RECORDS)
        .collect();
    let words: BTreeSet<u32> = want.iter().map(|p| p / BUCKET_PAGE_RECORDS / 64).collect();
    assert!(
        words.len() > 1,
        "all the pages in one word of flags: {words:?}"
    );
    // One word, then stop.
    let mut asked = 0;
    let mut got = BTreeSet::new();
    let next = maps.new_pages().take_from(
        0,
        || {
            asked += 1;
            asked == 1
        },
        |p| {
            got.insert(p);
        },
    );
    let first = *words.first().unwrap();
    assert_eq!(next, words.iter().nth(1).copied(), "where the pass stopped");
    assert!(got.iter().all(|p| p / BUCKET_PAGE_RECORDS / 64 == first));
    assert!(
        maps.new_pages().any(),
        "the flags after the stop were taken"
    );
    let rest = maps.new_pages().take_from(
        next.unwrap(),
        || true,
        |p| {
            assert!(got.insert(p), "page {p} taken twice");
        },
    );
    assert_eq!(rest, None);
    assert_eq!(got, want);
    assert!(!maps.new_pages().any());
}

/// A bucket of a cluster-scoped limit is left in its grown slot from its second packet on, with
/// its count, every charge up to 65 packets and then around each power of two; a plain rule's
/// never is; a heavier record in the slot stays, a lighter one is replaced.
#[test]
fn a_cluster_key_passing_a_power_of_two_is_left_in_its_grown_slot() {
    require_root();
    let (dp, maps, c, plain) = two_rules("grown", 4096, 100_000);
    let _ = maps.new_pages().take_grown();

    // A plain rule's source: never.
    let p = Ipv4Addr::new(198, 19, 1, 1);
    passes(&dp, p, 300);
    let _ = record(&maps, plain, p);
    assert_eq!(
        maps.new_pages().take_grown(),
        vec![],
        "a plain rule's bucket"
    );

    // The cluster-scoped one: not at its first packet (its page is flagged), then its count at
    // each charge (the packets before it).
    let s = Ipv4Addr::new(198, 18, 1, 1);
    assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    let i = record(&maps, c, s);
    assert_eq!(maps.new_pages().take_grown(), vec![], "at its first packet");
    assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    assert_eq!(maps.new_pages().take_grown(), vec![(i, 1)]);
    passes(&dp, s, 98);
    assert_eq!(maps.new_pages().take_grown(), vec![(i, 99)]);
    // Counts 100..=128 are within 65 of 64 or 128; so are 129..=192 of 128; 193..=255 of
    // none.
    passes(&dp, s, 29);
    assert_eq!(maps.new_pages().take_grown(), vec![(i, 128)]);
    passes(&dp, s, 64);
    assert_eq!(maps.new_pages().take_grown(), vec![(i, 192)]);
    passes(&dp, s, 63);
    assert_eq!(maps.new_pages().take_grown(), vec![], "counts 193-255");
    assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    assert_eq!(maps.new_pages().take_grown(), vec![(i, 256)]);

    // Another record, heavier, holds the slot: it stays. A lighter one: replaced.
    let other = (i + 1) % 4096;
    let heavier = grown_entry(100_000, other);
    maps.new_pages().put_grown(grown_slot(i), heavier);
    assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    assert_eq!(maps.new_pages().take_grown(), vec![(other, 100_000)]);
    maps.new_pages()
        .put_grown(grown_slot(i), grown_entry(3, other));
    assert_eq!(dp.run(&udp4(s)), XDP_PASS);
    assert_eq!(maps.new_pages().take_grown(), vec![(i, 258)]);
}
