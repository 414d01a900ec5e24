//! The targets, judged from a whole report: each says what is asked, whether this run's
//! figures meet it, and the figures behind the verdict.

use crate::{
    kernel,
    report::{Report, Target},
};

/// The targets, each judged from this run's figures, in the order the table prints them.
pub fn targets(r: &Report) -> Vec<Target> {
    let mut t = Vec::new();
    hot_path(r, &mut t);
    store_over_floors(r, &mut t);
    store_against_f1(r, &mut t);
    store_against_lru(r, &mut t);
    memory_and_control(r, &mut t);
    end_to_end(r, &mut t);
    layered_and_polite(r, &mut t);
    for target in &mut t {
        if target.met.is_none() {
            target.evidence = "not measured in this run".into();
        }
    }
    t
}

/// The in-kernel hot path: an admitted and a dropped packet against the floor, several limits
/// against one, and what the handling of cut packets adds.
fn hot_path(r: &Report, t: &mut Vec<Target>) {
    for (key, what, most) in [
        ("kernel.limiter.admitted", "admitted", 2.5),
        (
            "kernel.limiter.admitted_coarse_only",
            "admitted, a rule on the coarse clock alone",
            2.5,
        ),
        ("kernel.limiter.dropped", "dropped", 3.0),
    ] {
        let x = ratio(r, key, "kernel.floor");
        t.push(Target {
            goal: format!("limiter hot path ({what}) <= {most}x the floor's ns/packet"),
            met: x.map(|x| x <= most),
            evidence: format!(
                "{} ns vs floor {} ns: {}x",
                fmt(r.value(key)),
                fmt(r.value("kernel.floor")),
                fmt(x)
            ),
        });
    }
    for (key, n, most) in [
        ("kernel.limiter.limits_2", 2, 1.5),
        ("kernel.limiter.limits_3", 3, 2.0),
    ] {
        let x = ratio(r, key, "kernel.limiter.limits_1");
        let floor = r.value("kernel.floor_limits");
        t.push(Target {
            goal: format!(
                "admitted packet under a rule with {n} limits <= {most}x the one-limit figure"
            ),
            met: x.map(|x| x <= most),
            evidence: format!(
                "{} ns vs {} ns: {}x (over the floor {} ns: {} vs {} ns)",
                fmt(r.value(key)),
                fmt(r.value("kernel.limiter.limits_1")),
                fmt(x),
                fmt(floor),
                fmt(over(r, key, "kernel.floor_limits")),
                fmt(over(r, "kernel.limiter.limits_1", "kernel.floor_limits")),
            ),
        });
    }
    {
        let (with, without, diff) = kernel::cut_ab_keys("admitted");
        let d = r.value(&diff);
        t.push(Target {
            goal: "the handling of cut packets adds <= 2 ns to a whole packet's admitted figure \
                   (with and without it, alternately in this run)"
                .into(),
            met: d.map(|d| d <= 2.0),
            evidence: format!(
                "{} ns with vs {} ns without: {} ns (median of the paired differences)",
                fmt(r.value(&with)),
                fmt(r.value(&without)),
                fmt(d),
            ),
        });
    }
}

/// The bucket store: a known and a new source over their driver floors.
fn store_over_floors(r: &Report, t: &mut Vec<Target>) {
    let tracked = |key: &str| {
        r.get(key)
            .and_then(|f| f.detail["tracked_buckets"].as_u64())
            .map_or_else(|| "?".into(), |v| v.to_string())
    };
    for (key, floor, goal, most) in [
        (
            "kernel.pop.1m.known",
            "kernel.pop.1m.known_floor",
            "random known source with 1M tracked <= 200 ns over its floor",
            200.0,
        ),
        (
            "kernel.pop.full.new",
            "kernel.pop.full.new_floor",
            "new source with the store full <= 150 ns over its floor",
            150.0,
        ),
    ] {
        let x = over(r, key, floor);
        // What one random record of the store costs by itself in the same population (see
        // `progs::Touch`): the part of the figure no store layout can save.
        let memory = over(r, &format!("{key}_memory_floor"), floor);
        // A lookup reads the records of the key's two sets (a new key's, all eight of them).
        let candidates = over(r, &format!("{key}_candidates_floor"), floor)
            .map(|c| {
                format!(
                    "; 8 records of two sets of a page alone: {} ns",
                    fmt(Some(c))
                )
            })
            .unwrap_or_default();
        // A new source's first packet passes without a bucket (a first-packet slot): beside
        // it, what one that makes its bucket costs (`kernel.pop.*.new_made`).
        let made = over(r, &format!("{key}_made"), floor)
            .map(|m| format!("; a new source making its bucket: {} ns over", fmt(Some(m))))
            .unwrap_or_default();
        t.push(Target {
            goal: goal.into(),
            met: x.map(|x| x <= most),
            evidence: format!(
                "{} ns vs driver floor {} ns: {} ns over ({} buckets tracked); reading one \
                 random record of the store alone: {} ns over the same driver floor{}",
                fmt(r.value(key)),
                fmt(r.value(floor)),
                fmt(x),
                tracked(key),
                fmt(memory),
                candidates,
            ) + &made,
        });
    }
}

/// The bucket store against F1, one dependent read of a region the size of the store (issue #36,
/// `f1.rs`): the true floor of a source whose record is not in any cache.
fn store_against_f1(r: &Report, t: &mut Vec<Target>) {
    let f1 = r.value("kernel.f1");
    for (key, floor, most, stretch, what) in [
        (
            "kernel.pop.1m.known",
            "kernel.pop.1m.known_floor",
            1.6,
            None,
            "random known source with 1M tracked",
        ),
        (
            "kernel.pop.full.new",
            "kernel.pop.full.new_floor",
            2.0,
            Some(1.5),
            "new source with the store full",
        ),
    ] {
        let x = over(r, key, floor).zip(f1).map(|(a, f)| a / f);
        // The driver reading the key's records and charging one with a locked add, and no more
        // (`progs::Touch::ChargedCandidates`): the memory part of the path, as it orders.
        let charged = over(r, &format!("{key}_charged_floor"), floor);
        t.push(Target {
            goal: format!(
                "{what}: <= {most}x F1 over its floor{}",
                stretch.map_or_else(String::new, |s| format!(" (stretch {s}x)"))
            ),
            met: x.map(|x| x <= most),
            evidence: format!(
                "{} ns over vs F1 {} ns: {}x{}; the memory a charge cannot do without, the key's \
                 8 records and one locked add to one of them, alone: {} ns over ({}x F1)",
                fmt(over(r, key, floor)),
                fmt(f1),
                fmt(x),
                match (stretch, x) {
                    (Some(s), Some(x)) if x <= s => format!("; stretch {s}x met"),
                    (Some(s), Some(_)) => format!("; stretch {s}x missed"),
                    _ => String::new(),
                },
                fmt(charged),
                fmt(charged.zip(f1).map(|(c, f)| c / f)),
            ),
        });
    }
}

/// The bucket store against the LRU contender (issue #36, `lru.rs`): the limiter's ns over the
/// driver floor against the contender's, measured in turns with it over the same floor.
fn store_against_lru(r: &Report, t: &mut Vec<Target>) {
    for (key, lru, floor, most, what) in [
        (
            "kernel.pop.1m.known",
            "known_1m",
            "kernel.pop.1m.known_floor",
            0.55,
            "random known source with 1M tracked",
        ),
        (
            "kernel.pop.full.new",
            "new_full",
            "kernel.pop.full.new_floor",
            0.45,
            "new source with the store full",
        ),
    ] {
        let ours = over(r, key, floor);
        let shared = over(r, &format!("kernel.lru.{lru}"), floor);
        let percpu = over(r, &format!("kernel.lru_percpu.{lru}"), floor);
        let x = ours.zip(shared).map(|(a, b)| a / b);
        t.push(Target {
            goal: format!(
                "{what}: limiter <= {most}x the LRU contender's ns over the driver floor"
            ),
            met: x.map(|x| x <= most),
            evidence: format!(
                "limiter {} ns over vs LRU_HASH {} ns over: {}x; LRU_PERCPU_HASH {} ns over \
                 ({}x){}",
                fmt(ours),
                fmt(shared),
                fmt(x),
                fmt(percpu),
                fmt(ours.zip(percpu).map(|(a, b)| a / b)),
                // The least any layout that reads the source's record pays in this driver (its
                // runs' reads overlap, so below F1): the goal against it.
                over(r, &format!("{key}_memory_floor"), floor)
                    .map(|m| format!(
                        "; goal {} ns, one random record of the store alone {} ns",
                        fmt(shared.map(|s| s * most)),
                        fmt(Some(m))
                    ))
                    .unwrap_or_default(),
            ),
        });
    }
}

/// Kernel memory per tracked source, and a rule change among 10,000.
fn memory_and_control(r: &Report, t: &mut Vec<Target>) {
    let mem = r.value("memory.kernel_per_tracked_source");
    t.push(Target {
        goal: "<= 64 bytes of kernel memory per tracked source (store full; tags and first-packet \
               slots included)"
            .into(),
        met: mem.map(|m| m <= 64.0),
        evidence: r
            .get("memory.kernel_per_tracked_source")
            .map_or_else(String::new, |f| {
                format!(
                    "{} bytes: the store, its tags and first-packet slots {} bytes a record \
                     (memlock {} of {} records vs {} of {}; a fixed {} bytes beside them), over \
                     {} tracked buckets ({} with the store's fixed part)",
                    fmt(mem),
                    f.detail["bytes_per_record"],
                    f.detail["memlock_bytes"],
                    f.detail["max_entries"],
                    f.detail["second_memlock_bytes"],
                    f.detail["second_max_entries"],
                    f.detail["fixed_bytes"],
                    f.detail["tracked_buckets"],
                    f.detail["memlock_per_tracked"],
                )
            }),
    });
    let change = r.value("control.full.change_1_of_10k");
    t.push(Target {
        goal: "change 1 of 10,000 rules with ~1M tracked <= 100 ms".into(),
        met: change.map(|c| c <= 100.0),
        evidence: format!(
            "{} ms ({})",
            fmt(change),
            r.get("control.full.change_1_of_10k")
                .map_or_else(String::new, |f| f.label.clone())
        ),
    });
}

/// End to end: the hot source against drop-all, the random flood against XDP_PASS and the LRU
/// contender, known sources against nftables.
fn end_to_end(r: &Report, t: &mut Vec<Target>) {
    let x = ratio(r, "e2e.hot.limiter", "e2e.hot.drop_all");
    t.push(Target {
        goal: "end to end, hot source: limiter >= 95% of the drop-all floor (#36: >= 90%)".into(),
        met: x.map(|x| x >= 0.95),
        evidence: format!(
            "{} Mpps vs {} Mpps: {}%; #36's 90%: {}{}{}",
            fmt(r.value("e2e.hot.limiter")),
            fmt(r.value("e2e.hot.drop_all")),
            fmt(x.map(|x| x * 100.0)),
            verdict(x.map(|x| x >= 0.90)),
            beside_hot_floor(r, "lru", "LRU_HASH"),
            beside_hot_floor(r, "read_drop", "reading the frame's source, then dropping"),
        ),
    });
    let x = ratio(r, "e2e.random.limiter", "e2e.random.xdp_pass");
    t.push(Target {
        goal: "end to end, random sources: limiter >= 85% of an XDP_PASS receiver, in turns \
               (#36: >= 80%)"
            .into(),
        met: x.map(|x| x >= 0.85),
        evidence: format!(
            "{} Mpps vs {} Mpps: {}%; #36's 80%: {}",
            fmt(r.value("e2e.random.limiter")),
            fmt(r.value("e2e.random.xdp_pass")),
            fmt(x.map(|x| x * 100.0)),
            verdict(x.map(|x| x >= 0.80)),
        ),
    });
    let x = ratio(r, "e2e.known.limiter", "e2e.known.nftables");
    t.push(Target {
        goal: "end to end, known sources (2^19, tables half full): limiter >= 1.3x nftables' \
               dynamic set"
            .into(),
        met: x.map(|x| x >= 1.3),
        evidence: format!(
            "{} Mpps vs {} Mpps: {}x (LRU_HASH {} Mpps, LRU_PERCPU_HASH {} Mpps; XDP_PASS {} Mpps)",
            fmt(r.value("e2e.known.limiter")),
            fmt(r.value("e2e.known.nftables")),
            fmt(x),
            fmt(r.value("e2e.known.lru")),
            fmt(r.value("e2e.known.lru_percpu")),
            fmt(r.value("e2e.known.xdp_pass")),
        ),
    });
    let x = ratio(r, "e2e.random.limiter", "e2e.random.lru");
    t.push(Target {
        goal: "end to end, random sources: limiter >= 1.25x the LRU contender (XDP, LRU_HASH)"
            .into(),
        met: x.map(|x| x >= 1.25),
        evidence: format!(
            "{} Mpps vs {} Mpps: {}x (LRU_PERCPU_HASH {} Mpps)",
            fmt(r.value("e2e.random.limiter")),
            fmt(r.value("e2e.random.lru")),
            fmt(x),
            fmt(r.value("e2e.random.lru_percpu")),
        ),
    });
}

/// End to end under layered limits (a per-source and a per-rule limit, in either order) against
/// nftables, and the polite source beside the floods.
fn layered_and_polite(r: &Report, t: &mut Vec<Target>) {
    for (key, nft_key, order) in [
        (
            "e2e.random.limiter_aggregate",
            "e2e.random.nftables_aggregate",
            "per-source limit first",
        ),
        (
            "e2e.random.limiter_aggregate_first",
            "e2e.random.nftables_aggregate_first",
            "per-rule limit first",
        ),
    ] {
        let nft = ratio(r, nft_key, "e2e.random.drop_all_layered");
        let x = ratio(r, key, "e2e.random.drop_all_layered");
        t.push(Target {
            goal: format!(
                "end to end, random sources under a per-source + per-rule limit ({order}; the \
                 excess dropped by the aggregate): limiter >= 90% of the drop-all floor"
            ),
            met: x.map(|x| x >= 0.90),
            evidence: format!(
                "{} Mpps vs floor {} Mpps: {}%; nftables with the same two levels in the same \
                 order {} Mpps ({}% of the floor; limiter {}x nftables)",
                fmt(r.value(key)),
                fmt(r.value("e2e.random.drop_all_layered")),
                fmt(x.map(|x| x * 100.0)),
                fmt(r.value(nft_key)),
                fmt(nft.map(|x| x * 100.0)),
                fmt(ratio(r, key, nft_key)),
            ),
        });
    }
    let mut polite = Vec::new();
    let mut met = Some(true);
    for pattern in ["hot", "random"] {
        let Some(f) = r.get(&format!("e2e.{pattern}.limiter")) else {
            met = None;
            continue;
        };
        let p = &f.detail["polite"];
        let dropped = p["bucket_dropped"].as_u64();
        let (sent, received) = (p["sent"].as_u64(), p["received"].as_u64());
        if dropped != Some(0) {
            met = met.map(|_| false);
        }
        polite.push(format!(
            "{pattern}: sent {}, received {}, dropped by the limiter {}",
            sent.map_or("?".into(), |v| v.to_string()),
            received.map_or("?".into(), |v| v.to_string()),
            dropped.map_or("? (bucket evicted)".into(), |v| v.to_string()),
        ));
    }
    t.push(Target {
        goal: "a polite known source (200 pps) is never dropped during the floods".into(),
        met,
        evidence: if polite.is_empty() {
            "not measured".into()
        } else {
            polite.join("; ")
        },
    });
}

/// `; <what> X Mpps (Y% of the floor)` for the hot group's contender `tag`, if it ran.
fn beside_hot_floor(r: &Report, tag: &str, what: &str) -> String {
    let key = format!("e2e.hot.{tag}");
    r.value(&key).map_or(String::new(), |v| {
        format!(
            "; {what} {} Mpps ({}% of the floor)",
            fmt(Some(v)),
            fmt(ratio(r, &key, "e2e.hot.drop_all").map(|x| x * 100.0)),
        )
    })
}

/// `a / b` of the medians, if both were measured.
fn ratio(r: &Report, a: &str, b: &str) -> Option<f64> {
    Some(r.value(a)? / r.value(b)?)
}

/// `key - floor` of the medians (ns over a driver floor measured next to it), if both were
/// measured.
fn over(r: &Report, key: &str, floor: &str) -> Option<f64> {
    Some(r.value(key)? - r.value(floor)?)
}

/// A figure for a target's evidence, or that it was not measured.
fn fmt(v: Option<f64>) -> String {
    v.map_or_else(|| "not measured".to_string(), |v| format!("{v:.2}"))
}

/// A second threshold's verdict, printed in a target's evidence.
fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "missed",
        None => "n/a",
    }
}
