//! The agent's own cost: the real `ratelimit agent` (release build) attached to the receiving veth
//! of a fresh test bed, its CPU time and resident memory read from /proc, idle and while the
//! random-source generator floods the veth.

use std::{
    fs,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use ratelimit_testbed::AgentProcess;
use serde_json::json;

use crate::{
    e2e::Testbed,
    refs::Refs,
    report::{Figure, Report},
    session::Options,
};

const SECTION: &str = "Agent (release build, attached to the receiving veth)";

/// The pid of the agent started with config file `config`: the process whose command line names
/// it and whose name is `ratelimit` (the launch chain execs into the agent, see `AgentProcess`).
pub fn agent_pid(config: &Path) -> Result<u32> {
    let needle = config.as_os_str().as_encoded_bytes();
    for entry in fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let comm = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim() == "ratelimit" && cmdline.split(|&b| b == 0).any(|arg| arg == needle) {
            return Ok(pid);
        }
    }
    bail!(
        "no ratelimit process with {} on its command line",
        config.display()
    )
}

/// CPU time of every thread of `pid`, in nanoseconds (/proc/PID/task/*/schedstat, first field).
pub fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0;
    for task in fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
        if let Ok(s) = fs::read_to_string(task.path().join("schedstat")) {
            total += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Ok(total)
}

/// A `Vm*` field of /proc/PID/status in KiB (`field` with its colon: `"VmHWM:"`).
pub fn vm_field(pid: u32, field: &str) -> Result<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// Resident memory of `pid` in KiB (VmRSS).
pub fn rss_kib(pid: u32) -> Result<u64> {
    vm_field(pid, "VmRSS:")
}

/// One window: CPU share (percent of one core), and RSS and its anonymous part (MiB) at its end.
fn window(pid: u32, during: impl FnOnce() -> Result<()>) -> Result<(f64, f64, f64)> {
    let (c0, t0) = (cpu_ns(pid)?, Instant::now());
    during()?;
    let (c1, secs) = (cpu_ns(pid)?, t0.elapsed().as_secs_f64());
    #[expect(clippy::cast_precision_loss, reason = "nanoseconds and KiB")]
    Ok((
        (c1 - c0) as f64 / 1e9 / secs * 100.0,
        rss_kib(pid)? as f64 / 1024.0,
        vm_field(pid, "RssAnon:")? as f64 / 1024.0,
    ))
}

/// Idle and flooded CPU and memory of the agent.
pub fn run(report: &mut Report, opts: &Options, refs: &Refs) -> Result<()> {
    crate::session::announce("agent CPU and memory, idle and under a random-source flood");
    let bed = Testbed::new()?;
    let config = format!(
        "[agent]\ninterfaces = [\"{}\"]\nmode = \"native\"\n\n[[rule]]\nname = \"per-source\"\n\
         source = \"0.0.0.0/0\"\nrate = 1000\nburst = 2000\nper = \"source\"\n",
        bed.rx_if()
    );
    let agent = AgentProcess::start(bed.rx(), &config, &[])?;
    let pid = agent_pid(agent.config_path())?;
    // Let start-up work (loading, first stats pass) finish.
    thread::sleep(Duration::from_millis(500));
    let window_time = opts.e2e_run;
    let (mut idle_cpu, mut idle_rss, mut flood_cpu, mut flood_rss) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut idle_anon, mut flood_anon) = (Vec::new(), Vec::new());
    let mut flood_mpps = Vec::new();
    for _ in 0..opts.runs {
        crate::session::check_interrupted()?;
        let (c, m, a) = window(pid, || {
            thread::sleep(window_time);
            Ok(())
        })?;
        idle_cpu.push(c);
        idle_rss.push(m);
        idle_anon.push(a);
    }
    for _ in 0..opts.runs {
        crate::session::check_interrupted()?;
        let (c, m, a) = window(pid, || {
            let b = bed.blast_random(refs, window_time, opts.cpu)?;
            #[expect(clippy::cast_precision_loss, reason = "frame counts")]
            flood_mpps.push(b.frames as f64 / b.elapsed.as_secs_f64() / 1e6);
            Ok(())
        })?;
        flood_cpu.push(c);
        flood_rss.push(m);
        flood_anon.push(a);
    }
    let stats = agent.stats();
    let status = agent.stop()?;
    let detail = json!({
        "pid": pid,
        "window_seconds": window_time.as_secs_f64(),
        "generator_mpps_during_flood": flood_mpps,
        "agent_exit": status.to_string(),
        "agent_new_buckets": ratelimit_testbed::agent_proc::global_counter(&stats, "new_buckets"),
    });
    for (key, label, unit, runs) in [
        ("agent.idle.cpu", "agent CPU, idle", "% core", idle_cpu),
        (
            "agent.flood.cpu",
            "agent CPU, random-source flood",
            "% core",
            flood_cpu,
        ),
        (
            "agent.idle.rss",
            "agent resident memory (VmRSS, with the mapped store), idle",
            "MiB",
            idle_rss,
        ),
        (
            "agent.flood.rss",
            "agent resident memory (VmRSS), random-source flood",
            "MiB",
            flood_rss,
        ),
        (
            "agent.idle.anon",
            "agent anonymous memory (RssAnon: its heap), idle",
            "MiB",
            idle_anon,
        ),
        (
            "agent.flood.anon",
            "agent anonymous memory (RssAnon), random-source flood",
            "MiB",
            flood_anon,
        ),
    ] {
        report.add(Figure {
            key: key.into(),
            section: SECTION,
            label: label.into(),
            unit,
            runs,
            baseline: None,
            detail: detail.clone(),
        });
    }
    Ok(())
}
