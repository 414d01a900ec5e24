//! What every part of a run shares: its settings ([`Options`]), progress lines on stderr
//! ([`announce`]), the flag that SIGINT, SIGTERM and SIGHUP set ([`check_interrupted`]), and the
//! facts about the machine that head every report ([`machine`]). The parts use it; it uses none.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, OnceLock,
    },
    time::Duration,
};

use anyhow::{bail, Result};
use serde_json::json;

/// Settings every part reads.
#[derive(Debug)]
pub struct Options {
    /// Runs per figure.
    pub runs: usize,
    /// Repeat count of in-kernel repeat measurements.
    pub repeat: u32,
    /// New sources per in-kernel new-source run.
    pub new_sources: usize,
    /// Length of one end-to-end run.
    pub e2e_run: Duration,
    /// Warm-up before each end-to-end contender.
    pub e2e_warmup: Duration,
    /// Smaller populations.
    pub quick: bool,
    /// Also the memory floors on a store of kmalloc'ed pages (see `progs::PagedStore`).
    pub paged_floors: bool,
    /// Also the key's 8 records read in stores of 64- and 56-byte records (see
    /// `progs::LayoutStore`).
    pub layout_floors: bool,
    /// Where to write the limiter's profile by source line over the populations (`--profile`;
    /// see `profile`), if wanted.
    pub profile: Option<std::path::PathBuf>,
    /// The end-to-end contenders to measure, by tag (empty: all).
    pub contenders: Vec<String>,
    /// The end-to-end traffic patterns to run, by tag (empty: all).
    pub patterns: Vec<String>,
    /// CPU of the end-to-end pipeline.
    pub cpu: usize,
}

static INTERRUPTED: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Fails once SIGINT, SIGTERM or SIGHUP arrived: long loops call it between measurements, and the
/// error unwinds through the guards that clean up.
pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.get().is_some_and(|f| f.load(Ordering::Relaxed)) {
        bail!("interrupted");
    }
    Ok(())
}

static START: OnceLock<std::time::Instant> = OnceLock::new();
/// `bench` or `soak`, for [`announce`].
static MODE: OnceLock<&'static str> = OnceLock::new();

/// Progress, on stderr, with the time since the start.
pub fn announce(what: &str) {
    let t = START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs_f64();
    let mode = MODE.get().copied().unwrap_or("bench");
    eprintln!("==> {mode} [{t:6.1} s]: {what}");
}

/// Starts the clock of [`announce`] for `mode` (`bench` or `soak`), and makes SIGINT, SIGTERM
/// and SIGHUP set the flag that [`check_interrupted`] reads. The binary calls it first.
pub fn start(mode: &'static str) {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        if let Err(e) = signal_hook::flag::register(sig, Arc::clone(&flag)) {
            eprintln!("ratelimit-bench: cannot handle signal {sig}: {e}");
        }
    }
    let _ = INTERRUPTED.set(flag);
    let _ = START.set(std::time::Instant::now());
    let _ = MODE.set(mode);
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn command_line(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Facts about the machine and the checkout, for the table's header and the JSON.
pub fn machine() -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0);
    json!({
        "date": command_line("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        "cpus": std::thread::available_parallelism().map(std::num::NonZero::get).unwrap_or(0),
        "cpu_model": model,
        "memory_mib": mem_kib / 1024,
        "loadavg_before": loadavg(),
        "git": command_line("git", &["describe", "--always", "--dirty"]),
        "nft": command_line("nft", &["-v"]),
        "iptables": command_line("iptables", &["-V"]),
    })
}
