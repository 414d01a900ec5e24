//! One hot source charged from every CPU at once: the admitted and the dropped hot frames on
//! one CPU alone, then on every CPU together (the same bucket from each).

use std::{sync::Barrier, time::Instant};

use anyhow::{Context as _, Result};
use aya::programs::Xdp;
use serde_json::json;

use super::{repeat_ns, v4_frame, Limiter, TRUNCATION};
use crate::{
    report::{Figure, Report},
    session::Options,
};

const SECTION_CPUS: &str =
    "One hot source charged from every CPU at once (BPF_PROG_TEST_RUN, a thread pinned to each CPU)";

/// How the cost of one hot source grows with CPUs: the admitted and the dropped hot frames run
/// on one CPU alone, then on every CPU at once (a thread pinned to each, started together, each
/// a BPF_PROG_TEST_RUN of `repeat` runs of the same frame: the same bucket from every CPU).
/// Reports the kernel's ns per packet on each CPU (the mean of the CPUs) against one CPU alone.
pub fn cpus(report: &mut Report, opts: &Options, limiter: &Limiter) -> Result<()> {
    let n = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    if n < 2 {
        crate::session::announce("one CPU only: no figure for the cost on several CPUs");
        return Ok(());
    }
    crate::session::announce(&format!(
        "in-kernel cost of one hot source on {n} CPUs at once"
    ));
    let prog = limiter.program();
    for (tag, what, frame) in [
        (
            "admitted",
            "known source, admitted",
            v4_frame([198, 18, 0, 1]),
        ),
        (
            "dropped",
            "known source, dropped",
            v4_frame([198, 18, 2, 1]),
        ),
    ] {
        repeat_ns(prog, &frame, 1000)?;
        let (mut one, mut all, mut each, mut overlaps) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..opts.runs {
            crate::session::check_interrupted()?;
            one.push(on_cpus(prog, &[0], &frame, opts.repeat)?[0].0);
            let cpus: Vec<usize> = (0..n).collect();
            let per_cpu = on_cpus(prog, &cpus, &frame, opts.repeat)?;
            overlaps.push(overlap(&per_cpu));
            let per_cpu: Vec<f64> = per_cpu.iter().map(|r| r.0).collect();
            #[expect(clippy::cast_precision_loss, reason = "a few CPUs")]
            all.push(per_cpu.iter().sum::<f64>() / n as f64);
            each.push(per_cpu);
        }
        eprintln!(
            "    {what}: calls overlapped {:.0}% (median of runs)",
            crate::report::median(&overlaps) * 100.0
        );
        let one_key = format!("kernel.cpus.{tag}.one");
        report.add(Figure {
            key: one_key.clone(),
            section: SECTION_CPUS,
            label: format!("{what}: one CPU alone (CPU 0)"),
            unit: "ns/pkt",
            runs: one,
            baseline: None,
            detail: json!({ "repeat": opts.repeat }),
        });
        report.add(Figure {
            key: format!("kernel.cpus.{tag}.all"),
            section: SECTION_CPUS,
            label: format!("{what}: {n} CPUs at once, per CPU (mean)"),
            unit: "ns/pkt",
            runs: all,
            baseline: Some(one_key),
            detail: json!({
                "repeat": opts.repeat,
                "cpus": n,
                "ns_per_cpu": each,
                "overlap": overlaps,
            }),
        });
    }
    Ok(())
}

/// `repeat` runs of `frame` through `prog` on each of `cpus` at once (a thread pinned to each,
/// started together): for each, the kernel's ns per run, and when its call started and ended.
fn on_cpus(
    prog: &Xdp,
    cpus: &[usize],
    frame: &[u8],
    repeat: u32,
) -> Result<Vec<(f64, Instant, Instant)>> {
    let start = Barrier::new(cpus.len());
    let run_on = |cpu: usize| -> Result<(f64, Instant, Instant)> {
        ratelimit_testbed::xdp::pin_to_cpu(cpu).with_context(|| format!("pinning to CPU {cpu}"))?;
        start.wait();
        let t0 = Instant::now();
        let ns = repeat_ns(prog, frame, repeat)?.0 + TRUNCATION;
        Ok((ns, t0, Instant::now()))
    };
    std::thread::scope(|s| {
        let threads: Vec<_> = cpus
            .iter()
            .map(|&cpu| {
                let run_on = &run_on;
                s.spawn(move || run_on(cpu))
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .map_err(|_| anyhow::anyhow!("a test-run thread panicked"))?
            })
            .collect()
    })
}

/// How much of the longest call ran while every call ran (1: fully at once).
fn overlap(per_cpu: &[(f64, Instant, Instant)]) -> f64 {
    let first_end = per_cpu.iter().map(|r| r.2).min().expect("threads");
    let last_start = per_cpu.iter().map(|r| r.1).max().expect("threads");
    let longest = per_cpu
        .iter()
        .map(|r| (r.2 - r.1).as_secs_f64())
        .fold(0.0, f64::max);
    first_end
        .checked_duration_since(last_start)
        .map_or(0.0, |d| d.as_secs_f64() / longest.max(1e-9))
}
