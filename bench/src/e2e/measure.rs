//! One contender's measurement: attached, its tables filled and the flood warmed up, runs of the
//! generator with the polite and the fresh flooding source beside them, detached; and a group's
//! contenders measured in turns.

use std::{net::SocketAddr, thread, time::Duration};

use anyhow::Result;
use aya::programs::Xdp;
use ratelimit_common::{global, BucketKey};
use ratelimit_testbed::{send_udp_from, Receiver};
use serde_json::{json, Value};

use super::{
    contenders::{contender_count, setup, teardown, Contender, Count},
    Pattern, Testbed, ABUSER, ABUSER_PPS, ABUSER_SPAN, BURST, KNOWN_WARMUP_LIMIT, POLITE,
    POLITE_PPS, PREFILL_FROM, RATE, SERVER, TRACKED, WARMUP_LIMIT,
};
use crate::{
    generator::{blast, pin_to_cpu},
    kernel::Limiter,
    refs::{Refs, TX},
    report::Figure,
    session::Options,
};

/// The layered cases and their floor, measured in turns (see [`measure_group`]): their targets
/// are ratios of a few percent, and on this machine a contender's rate moved by more than that
/// between runs a few seconds apart (runs of one floor: 1.84..1.92 Mpps; measured one after the
/// other, the two layered cases read 84% to 95% of it over six sessions).
pub(super) const LAYERED_GROUP: [Contender; 3] = [
    Contender::DropAllLayered,
    Contender::LimiterAggregate,
    Contender::LimiterAggregateFirst,
];

/// Fewest turns of a group (see [`measure_group`]), whatever `--runs` says: one run of this
/// flood moves by up to +-8% (on this machine, the floor's runs read 1.72..2.07 Mpps in one
/// group), and a target of a few percent needs the median of more runs than a figure that stands
/// alone.
const MIN_TURNS: usize = 10;

/// One turn of a contender's measurement.
#[derive(Clone, Copy)]
struct Turn {
    /// Runs in this turn.
    runs: usize,
    /// The contender's first turn: its tables are filled and the flood warmed up in full; a later
    /// turn finds them as the first left them (the limiter's maps stay; its caches hold what
    /// packets would compute anyway) and warms up for `--warmup` seconds only, after the attach.
    first: bool,
    /// The fresh flooding source sends during this turn's last run.
    abuser: bool,
}

/// Measures `group`'s contenders: a lone contender runs all its runs at once; a group's take
/// turns of one run each (attached, warmed up, measured, detached; at least [`MIN_TURNS`] of
/// them; the order reversed every other round), so that what the machine does
/// over the minutes of a bench weighs alike on each and their ratio compares like with like.
/// Each contender's figure has all its runs; its details are its first turn's, with the
/// polite and fresh source's counts summed over all turns (the polite source's bucket counters
/// the last turn's) and every turn's kept in `turns`.
pub(super) fn measure_group(
    opts: &Options,
    refs: &mut Refs,
    bed: &Testbed,
    limiter: &mut Limiter,
    pattern: Pattern,
    group: &[Contender],
) -> Result<Vec<(Contender, Figure)>> {
    if let [contender] = group {
        let turn = Turn {
            runs: opts.runs,
            first: true,
            abuser: true,
        };
        let figure = measure(opts, refs, bed, limiter, pattern, *contender, turn)?;
        return Ok(vec![(*contender, figure)]);
    }
    let mut turns: Vec<Vec<Figure>> = vec![Vec::new(); group.len()];
    let n = opts.runs.max(MIN_TURNS);
    for run in 0..n {
        // Which contender goes first alternates from round to round, so that none gains from
        // its place (the one after a detach and attach, or after another's flood).
        let order: Vec<usize> = if run % 2 == 0 {
            (0..group.len()).collect()
        } else {
            (0..group.len()).rev().collect()
        };
        for i in order {
            let contender = group[i];
            crate::session::check_interrupted()?;
            let turn = Turn {
                runs: 1,
                first: run == 0,
                abuser: run + 1 == n,
            };
            turns[i].push(measure(opts, refs, bed, limiter, pattern, contender, turn)?);
        }
    }
    Ok(group
        .iter()
        .copied()
        .zip(turns.into_iter().map(merge_turns))
        .collect())
}

/// One figure of a contender's turns (see [`measure_group`]).
fn merge_turns(turns: Vec<Figure>) -> Figure {
    let details: Vec<Value> = turns.iter().map(|f| f.detail.clone()).collect();
    let mut turns = turns.into_iter();
    let mut figure = turns.next().expect("at least one run");
    for t in turns {
        figure.runs.extend(t.runs);
    }
    for source in ["polite", "fresh_abuser"] {
        for count in ["sent", "received"] {
            let sum: u64 = details
                .iter()
                .filter_map(|d| d[source][count].as_u64())
                .sum();
            figure.detail[source][count] = json!(sum);
        }
    }
    // The polite source's bucket counters are read whole after each turn: the last turn's.
    if let Some(last) = details.last() {
        for count in ["bucket_passed", "bucket_dropped"] {
            if !last["polite"][count].is_null() {
                figure.detail["polite"][count] = last["polite"][count].clone();
            }
        }
    }
    figure.detail["turns"] = Value::Array(details);
    figure
}

fn measure(
    opts: &Options,
    refs: &mut Refs,
    bed: &Testbed,
    limiter: &mut Limiter,
    pattern: Pattern,
    contender: Contender,
    turn: Turn,
) -> Result<Figure> {
    let attached = setup(refs, bed, limiter, contender)?;
    let result = measure_attached(opts, refs, bed, limiter, pattern, contender, turn);
    let down = teardown(refs, bed, limiter, contender, attached);
    let figure = result?;
    down?;
    Ok(figure)
}

/// One turn of `contender` attached: the limiter's store filled, the flood warmed up, the runs
/// beside the polite and the fresh source, and what the contender and the limiter counted.
fn measure_attached(
    opts: &Options,
    refs: &Refs,
    bed: &Testbed,
    limiter: &Limiter,
    pattern: Pattern,
    contender: Contender,
    turn: Turn,
) -> Result<Figure> {
    let (generator, frame) = match pattern {
        Pattern::Hot => (refs.program(TX), &bed.hot_frame),
        Pattern::Random => (refs.random(), &bed.random_frame),
        Pattern::Known => (refs.known(), &bed.random_frame),
    };
    // Fill the limiter's store with other sources first (one packet each), so that it is measured
    // with its table full from the first run, as nftables' set is after its warm-up.
    let limiting = contender == Contender::Limiter || contender.layered();
    let prefilled = if limiting && pattern == Pattern::Random && turn.first {
        let n = limiter.tdp.maps().bucket_capacity()?;
        crate::kernel::fill(limiter, refs, PREFILL_FROM, n)?
    } else {
        0
    };
    let warm = warm_up(opts, bed, (generator, frame), pattern, turn)?;

    let receiver = Receiver::bind(&bed.rx, SocketAddr::new(SERVER.into(), 0))?;
    let global_before = limiter.tdp.global();
    let drops_before = contender_count(bed, limiter, contender)?;
    let runs = run_beside_polite(opts, bed, (generator, frame), &receiver, turn)?;
    let drops_after = contender_count(bed, limiter, contender)?;
    let global_after = limiter.tdp.global();

    let mut detail = json!({
        "generator_mpps": runs.sent_mpps,
        "ring_full_drops": runs.ring_drops,
        "run_seconds": opts.e2e_run.as_secs_f64(),
        "warmup_seconds": warm.secs,
        "warmup_frames": warm.frames,
        "warmup_mpps": warm.mpps,
        "handled_packets": runs.handled,
        "limiter_buckets_prefilled": prefilled,
        "limiter_buckets_tracked_after": if limiting {
            Some(limiter.tdp.maps().bucket_count()?)
        } else {
            None
        },
    });
    let dropped = match (drops_before, drops_after) {
        (Some(Count::Dropped(a)), Some(Count::Dropped(b))) => Some(b.saturating_sub(a)),
        (Some(Count::Passed(a)), Some(Count::Passed(b))) => {
            Some(runs.handled.saturating_sub(b.saturating_sub(a)))
        }
        _ => None,
    };
    if let Some(dropped) = dropped {
        detail["contender_dropped"] = json!(dropped);
        #[expect(clippy::cast_precision_loss, reason = "packet counts")]
        let share = if runs.handled > 0 {
            dropped as f64 / runs.handled as f64
        } else {
            0.0
        };
        detail["contender_dropped_share"] = json!(share);
    }
    let counts = receiver.stop()?.counts();
    let received = counts.get(&POLITE.into()).copied().unwrap_or(0);
    detail["fresh_abuser"] = json!({
        "pps": ABUSER_PPS,
        "sent": runs.abuser_sent,
        "received": counts.get(&ABUSER.into()).copied().unwrap_or(0),
        "limit_allows": BURST + RATE * u64::try_from(ABUSER_SPAN.as_millis()).unwrap_or(0) / 1000,
    });
    detail["polite"] = json!({ "pps": POLITE_PPS, "sent": runs.polite_sent, "received": received });
    if limiting {
        let d = |i: usize| global_after.counters[i] - global_before.counters[i];
        detail["limiter_new_buckets"] = json!(d(global::NEW_BUCKETS));
        detail["limiter_bucket_errors"] = json!(d(global::BUCKET_ERRORS));
        detail["limiter_evicted_full"] = json!(d(global::EVICTED_FULL));
        detail["limiter_evicted_lost"] = json!(d(global::EVICTED_LOST));
        limiter_detail(limiter, contender, &mut detail)?;
    }
    Ok(Figure {
        key: format!("e2e.{}.{}", pattern.tag(), contender.tag()),
        section: section(pattern, contender),
        label: contender.label().into(),
        unit: "Mpps",
        runs: runs.handled_mpps,
        baseline: baseline(pattern, contender),
        detail,
    })
}

/// How a turn's warm-up went.
struct Warmup {
    secs: f64,
    frames: u64,
    /// Frames the receiver handled a second, in millions.
    mpps: f64,
}

/// Warms the flood up. A random flood runs until the contender has seen 1.25 times as many
/// sources as it can track, so that the runs measure the steady state of a flood (every table
/// full); how fast it went while the tables were filling is kept apart. Known sources run until
/// 7 frames a source have gone by: all but e^-7 (0.1%) of the 2^19 sources then have their
/// entry. A later turn (see `Turn`) warms up for one `--warmup` only.
fn warm_up(
    opts: &Options,
    bed: &Testbed,
    (generator, frame): (&Xdp, &[u8]),
    pattern: Pattern,
    turn: Turn,
) -> Result<Warmup> {
    let (w0, _) = bed.rx_stats()?;
    let warm_start = std::time::Instant::now();
    let mut frames = 0;
    loop {
        frames += blast(
            generator,
            &bed.gen,
            bed.tx_ifindex,
            frame,
            opts.e2e_warmup,
            opts.cpu,
        )?
        .frames;
        let full = match pattern {
            Pattern::Known => frames >= 7 << crate::generator::KNOWN_BITS,
            _ => frames >= u64::from(TRACKED) * 5 / 4,
        };
        let limit = if pattern == Pattern::Known {
            KNOWN_WARMUP_LIMIT
        } else {
            WARMUP_LIMIT
        };
        if pattern == Pattern::Hot || !turn.first || full || warm_start.elapsed() > limit {
            break;
        }
        crate::session::check_interrupted()?;
    }
    let (w1, _) = bed.rx_stats()?;
    let secs = warm_start.elapsed().as_secs_f64();
    #[expect(clippy::cast_precision_loss, reason = "packet counts")]
    let mpps = (w1 - w0) as f64 / secs / 1e6;
    Ok(Warmup { secs, frames, mpps })
}

/// What a turn's runs measured.
struct Runs {
    /// Frames the receiver handled a second, in millions, each run.
    handled_mpps: Vec<f64>,
    /// Frames the generator sent a second, in millions, each run.
    sent_mpps: Vec<f64>,
    /// Frames the receiving ring had no room for, each run.
    ring_drops: Vec<f64>,
    /// Frames handled in all the runs.
    handled: u64,
    /// Datagrams the polite source sent.
    polite_sent: u64,
    /// Datagrams the fresh flooding source sent, if it sent in this turn.
    abuser_sent: Option<u64>,
}

/// The turn's runs of the generator, with the polite source sending to `receiver` during every
/// contender's runs (so that all carry the same load) and, in the turn's last run if it is the
/// turn for it, a fresh source flooding over its limit: is it limited?
fn run_beside_polite(
    opts: &Options,
    bed: &Testbed,
    (generator, frame): (&Xdp, &[u8]),
    receiver: &Receiver,
    turn: Turn,
) -> Result<Runs> {
    let run_time = opts.e2e_run;
    let mut runs = Runs {
        handled_mpps: Vec::new(),
        sent_mpps: Vec::new(),
        ring_drops: Vec::new(),
        handled: 0,
        polite_sent: 0,
        abuser_sent: None,
    };
    thread::scope(|s| -> Result<()> {
        let dst = receiver.local_addr();
        #[expect(clippy::cast_possible_truncation, reason = "seconds of a benchmark")]
        let span = run_time * (turn.runs as u32) + Duration::from_millis(200);
        let sender = s.spawn(move || {
            pin_to_cpu(opts.cpu)?;
            send_udp_from(
                &bed.gen,
                SocketAddr::new(POLITE.into(), 0),
                dst,
                POLITE_PPS,
                span,
                64,
            )
        });
        let mut abuser = None;
        for run in 0..turn.runs {
            crate::session::check_interrupted()?;
            if turn.abuser && run + 1 == turn.runs {
                abuser = Some(s.spawn(move || {
                    pin_to_cpu(opts.cpu)?;
                    thread::sleep(run_time / 5);
                    send_udp_from(
                        &bed.gen,
                        SocketAddr::new(ABUSER.into(), 0),
                        dst,
                        ABUSER_PPS,
                        ABUSER_SPAN,
                        64,
                    )
                }));
            }
            let (p0, d0) = bed.rx_stats()?;
            let b = blast(
                generator,
                &bed.gen,
                bed.tx_ifindex,
                frame,
                run_time,
                opts.cpu,
            )?;
            let (p1, d1) = bed.rx_stats()?;
            let secs = b.elapsed.as_secs_f64();
            #[expect(clippy::cast_precision_loss, reason = "packet counts")]
            {
                runs.handled_mpps.push((p1 - p0) as f64 / secs / 1e6);
                runs.sent_mpps.push(b.frames as f64 / secs / 1e6);
                runs.ring_drops.push((d1 - d0) as f64);
            }
            runs.handled += p1 - p0;
        }
        runs.abuser_sent = abuser
            .map(|h| h.join().expect("abuser thread"))
            .transpose()?
            .map(|r| r.sent);
        runs.polite_sent = sender.join().expect("polite sender thread")?.sent;
        Ok(())
    })?;
    Ok(runs)
}

/// What the limiter counted beyond its global counters: which limit dropped a layered flood,
/// and the polite source's bucket.
fn limiter_detail(limiter: &Limiter, contender: Contender, detail: &mut Value) -> Result<()> {
    if contender.layered() {
        // Which limit dropped the flood (since the rules were installed, warm-up included):
        // the aggregate, not the per-source one.
        let s = limiter.tdp.rule(limiter.id("layered")?);
        detail["limiter_dropped_by_limit"] = json!(s.limit_dropped_rate);
    }
    let id = limiter.id(contender.polite_rule())?;
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&POLITE.octets());
    let bucket = limiter.tdp.maps().bucket(&BucketKey {
        rule: id,
        family: 4,
        _pad: [0; 3],
        addr,
    })?;
    detail["polite"]["bucket_passed"] = json!(bucket.map(|b| b.passed_pkts));
    detail["polite"]["bucket_dropped"] = json!(bucket.map(|b| b.dropped_pkts));
    Ok(())
}

/// The figure a contender's rate is a ratio of.
fn baseline(pattern: Pattern, contender: Contender) -> Option<String> {
    match (pattern, contender) {
        (_, Contender::DropAll | Contender::DropAllLayered) => None,
        (Pattern::Random, c) if c.aggregate() => Some("e2e.random.drop_all_layered".into()),
        (Pattern::Hot, _) | (Pattern::Random | Pattern::Known, Contender::Pass) => {
            Some(format!("e2e.{}.drop_all", pattern.tag()))
        }
        (Pattern::Random | Pattern::Known, _) => Some(format!("e2e.{}.xdp_pass", pattern.tag())),
    }
}

/// The report's section of a pattern (the layered cases have their own).
fn section(pattern: Pattern, contender: Contender) -> &'static str {
    match (pattern, contender) {
        (Pattern::Random, c) if c.aggregate() => {
            "End to end, random spoofed sources against a per-source and a per-rule \
             (aggregate) limit: the excess dropped (veth, live-frames generator; Mpps handled)"
        }
        (Pattern::Hot, _) => {
            "End to end, one hot source (veth, live-frames generator; Mpps handled)"
        }
        (Pattern::Random, _) => {
            "End to end, random spoofed sources (veth, live-frames generator; Mpps handled)"
        }
        (Pattern::Known, _) => {
            "End to end, known sources: 2^19 of them, every table half full, each source back \
             again and again (veth, live-frames generator; Mpps handled)"
        }
    }
}
