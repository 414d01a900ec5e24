//! One host cut off from the store by an nftables rule, then healed.

use std::time::Instant;

use ratelimit_testbed::{
    cluster_net::{status, ClusterNet, Samples},
    require_root,
};
use serde_json::Value;

use crate::{flood, serial, store, within, Bed, ACCURACY, HOSTS, RATE, SAMPLE};

const CUT_AT: f64 = 7.0;
const HEAL_AT: f64 = 14.0;
const RUN: f64 = 27.0;

/// One host cut off from the store (an nftables rule in its namespace drops what it sends to
/// it: no reply at all, so its calls and its connection attempts time out): it shows the store
/// down with the timeout and enforces alone at the whole rate (fail open), while the two
/// others, its field gone stale, share one budget between them: 2 budgets in all (0.9-1.1 x
/// each). Healed, it reconnects by itself and the cluster is back to one budget (0.95-1.05 x).
#[test]
fn a_host_cut_off_from_the_store_enforces_alone_and_rejoins_when_healed() {
    require_root();
    let _serial = serial();
    let bed = Bed::start("rl-credisp", "", |_| {});
    let seen = flood_and_cut_h0_off_for_a_while(&bed);
    let fig = figures(&seen);
    assert_h0_alone_and_the_others_one_budget_while_cut(&fig, &seen);
    assert_one_budget_again_once_healed(&fig, &seen);

    bed.teardown("rl-credisp");
}

/// Cuts h0 off from the store (`on`) or heals it: an nftables table in h0's namespace whose
/// output hook drops what it sends to the store's address, 198.18.1.254.
fn cut(net: &ClusterNet, on: bool) {
    let ns = &net.hosts[0].ns;
    if on {
        ns.run(&["nft", "add", "table", "inet", "rlcut"]).unwrap();
        ns.run(&[
            "nft",
            "add",
            "chain",
            "inet",
            "rlcut",
            "out",
            "{ type filter hook output priority 0 ; }",
        ])
        .unwrap();
        ns.run(&[
            "nft",
            "add",
            "rule",
            "inet",
            "rlcut",
            "out",
            "ip",
            "daddr",
            "198.18.1.254",
            "drop",
        ])
        .unwrap();
    } else {
        ns.run(&["nft", "delete", "table", "inet", "rlcut"])
            .unwrap();
    }
}

/// What [`flood_and_cut_h0_off_for_a_while`] saw.
struct Seen {
    samples: Samples,
    /// h0's status 4 s into the cut.
    cut_view: Value,
    /// h0's status at the end.
    end_view: Value,
}

/// The flood for [`RUN`] s, sampled every [`SAMPLE`]: h0 cut off from the store from
/// [`CUT_AT`] to [`HEAL_AT`], its status read 4 s into the cut and at the end. Asserts
/// nothing: the figures come first.
fn flood_and_cut_h0_off_for_a_while(bed: &Bed) -> Seen {
    let Bed {
        receivers,
        agents,
        net,
        ..
    } = bed;
    let start = Instant::now();
    let sender = flood(net, RUN, start);
    let mut samples = Samples::default();
    samples.take_until(receivers, start, CUT_AT, SAMPLE);
    cut(net, true);
    samples.take_until(receivers, start, CUT_AT + 4.0, SAMPLE);
    let cut_view = status(&agents[0]).unwrap();
    samples.take_until(receivers, start, HEAL_AT, SAMPLE);
    cut(net, false);
    samples.take_until(receivers, start, RUN, SAMPLE);
    sender.join().unwrap();
    let end_view = status(&agents[0]).unwrap();
    Seen {
        samples,
        cut_view,
        end_view,
    }
}

/// The figures the assertions check, in budgets.
struct Figures {
    before: f64,
    /// h0 alone, and h1 and h2 together, while h0 was cut off.
    h0_cut: f64,
    others_cut: f64,
    healed: f64,
}

/// Prints what the cluster admitted before, during and after the cut, and h0's store during
/// and after it; all before any assertion, so a failing run shows them.
fn figures(seen: &Seen) -> Figures {
    let Seen {
        samples,
        cut_view,
        end_view,
    } = seen;
    let before = samples.rate(3.0, CUT_AT) / RATE;
    let cut = samples.rate(CUT_AT + 2.0, HEAL_AT) / RATE;
    let h0_cut = samples.host_rate(0, CUT_AT + 2.0, HEAL_AT) / RATE;
    let others_cut = cut - h0_cut;
    let healed = samples.rate(HEAL_AT + 8.0, RUN) / RATE;
    println!(
        "\n{HOSTS} hosts through Redis; h0 cut off from it {CUT_AT}-{HEAL_AT} s: before {before:.3} \
         budgets; cut {cut:.3} (h0 alone {h0_cut:.3}, h1 + h2 {others_cut:.3}); healed {healed:.3}"
    );
    println!("h0 cut off: store {}", store(cut_view));
    println!("h0 at the end: store {}", store(end_view));
    Figures {
        before,
        h0_cut,
        others_cut,
        healed,
    }
}

/// One budget ([`ACCURACY`]) before the cut. Cut off, h0 shows the store down with the timeout
/// (no reply at all) and enforces alone at its whole rate, while h1 and h2 share one budget
/// between them: with h0's field gone stale they no longer leave it a share.
fn assert_h0_alone_and_the_others_one_budget_while_cut(fig: &Figures, seen: &Seen) {
    let (before, h0_cut, others_cut, cut_view) =
        (fig.before, fig.h0_cut, fig.others_cut, &seen.cut_view);
    assert!(
        within(before, ACCURACY),
        "before the cut: {before:.3} budgets, want {ACCURACY:?}"
    );
    assert_eq!(store(cut_view)["state"], "down", "{}", store(cut_view));
    assert!(
        store(cut_view)["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("timed out") || e.contains("no answer within")),
        "{}",
        store(cut_view)
    );
    assert!(
        within(h0_cut, (0.9, 1.1)) && within(others_cut, (0.9, 1.1)),
        "cut off, h0 admitted {h0_cut:.3} budgets (want its whole rate, 0.9-1.1) and h1 + h2 \
         {others_cut:.3} (want one budget between them, 0.9-1.1)"
    );
}

/// Healed, h0 reconnects by itself and the cluster admits one budget again ([`ACCURACY`]).
fn assert_one_budget_again_once_healed(fig: &Figures, seen: &Seen) {
    let (healed, end_view) = (fig.healed, &seen.end_view);
    assert_eq!(store(end_view)["state"], "connected", "{}", store(end_view));
    assert!(
        within(healed, ACCURACY),
        "healed: {healed:.3} budgets, want {ACCURACY:?}"
    );
}
