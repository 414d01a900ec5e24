//! The agent's operator paths as the soak uses them: a CLI call (`ratelimit ... --json`) with a
//! timeout, the metrics scrape, one sample through all of them, a reload three ways; and reading
//! the answers and /proc.

use std::{
    fmt::Write as _,
    fs,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Command, Stdio},
    sync::atomic::Ordering,
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use ratelimit_testbed::{agent_binary, in_netns, AgentProcess, Receiver};
use serde_json::{json, Value};

use super::{Sample, Traffic, CALL_TIMEOUT, METRICS, RULE};
use crate::{
    agent::{agent_pid, rss_kib, vm_field},
    e2e::{Testbed, POLITE},
};

/// How a reload is asked for.
#[derive(Clone, Copy, Debug)]
pub(super) enum Reload {
    /// The config file is replaced (write and rename) with an equivalent one: the agent's file
    /// watcher reloads it.
    File,
    /// SIGHUP to the agent.
    Sighup,
    /// `ratelimit rules reload`.
    Cli,
}

impl Reload {
    pub(super) const ALL: [Reload; 3] = [Reload::File, Reload::Sighup, Reload::Cli];

    fn name(self) -> &'static str {
        match self {
            Reload::File => "config file rewritten",
            Reload::Sighup => "SIGHUP",
            Reload::Cli => "ratelimit rules reload",
        }
    }
}

/// The agent's operator paths, and what the soak reads besides.
pub(super) struct Ops<'a> {
    pub(super) socket: PathBuf,
    pub(super) bed: &'a Testbed,
}

impl Ops<'_> {
    /// `ratelimit --socket S ARGS`, its stdout parsed as JSON, and how long it took. Killed and
    /// failed after [`CALL_TIMEOUT`].
    pub(super) fn cli(&self, args: &[&str]) -> Result<(Value, Duration)> {
        let what = format!("ratelimit {}", args.join(" "));
        let t0 = Instant::now();
        let mut child = Command::new(agent_binary())
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting `{what}`"))?;
        let (mut out, mut err) = (
            child.stdout.take().expect("piped"),
            child.stderr.take().expect("piped"),
        );
        let reader = thread::spawn(move || {
            let (mut o, mut e) = (Vec::new(), Vec::new());
            let _ = out.read_to_end(&mut o);
            let _ = err.read_to_end(&mut e);
            (o, e)
        });
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if t0.elapsed() > CALL_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                bail!("`{what}` did not answer within {CALL_TIMEOUT:?}");
            }
            thread::sleep(Duration::from_millis(5));
        };
        let elapsed = t0.elapsed();
        let (o, e) = reader.join().expect("reader thread");
        if !status.success() {
            bail!(
                "`{what}` failed ({status}): {}",
                String::from_utf8_lossy(&e).trim()
            );
        }
        let v = serde_json::from_slice(&o)
            .with_context(|| format!("`{what}` printed {:?}", String::from_utf8_lossy(&o)))?;
        Ok((v, elapsed))
    }

    /// `GET /metrics` from the agent's endpoint (in the receiving namespace), and how long it took.
    fn metrics(&self) -> Result<(String, Duration)> {
        let t0 = Instant::now();
        let addr: SocketAddr = METRICS.parse().expect("a socket address");
        let mut conn = in_netns(self.bed.rx(), || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        })
        .with_context(|| format!("connecting to the metrics endpoint {METRICS}"))?;
        conn.set_read_timeout(Some(CALL_TIMEOUT))?;
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")?;
        let mut text = String::new();
        conn.read_to_string(&mut text)
            .context("reading the metrics answer")?;
        let elapsed = t0.elapsed();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        if !head.starts_with("HTTP/1.1 200") {
            bail!(
                "GET /metrics answered {:?}",
                head.lines().next().unwrap_or("")
            );
        }
        Ok((body.to_string(), elapsed))
    }

    /// One sample: /proc first (so that the figures are those of the agent at rest between
    /// calls), then every operator path in turn.
    pub(super) fn sample(
        &self,
        pid: u32,
        traffic: &Traffic,
        receiver: &Receiver,
        last: &mut (Instant, u64, (u64, u64), u64),
    ) -> Result<Sample> {
        let now = Instant::now();
        let frames = traffic.frames.load(Ordering::Relaxed);
        let rx = self.bed.rx_stats()?;
        let cpu = cpu_time_ns(pid)?;
        let secs = (now - last.0).as_secs_f64();
        #[expect(clippy::cast_precision_loss, reason = "counts and nanoseconds")]
        let mut s = Sample {
            rss_kib: rss_kib(pid)?,
            hwm_kib: vm_field(pid, "VmHWM:")?,
            cpu_pct: cpu.saturating_sub(last.3) as f64 / 1e9 / secs * 100.0,
            gen_mpps: (frames - last.1) as f64 / secs / 1e6,
            rx_mpps: (rx.0 - (last.2).0) as f64 / secs / 1e6,
            rx_ring_drops: rx.1 - (last.2).1,
            polite_sent: traffic.polite_sent.load(Ordering::Relaxed),
            polite_received: receiver.counts().get(&POLITE.into()).copied().unwrap_or(0),
            ..Sample::default()
        };
        *last = (now, frames, rx, cpu);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        match self.cli(&["status", "--json"]) {
            Ok((v, d)) => {
                s.ms_status = ms(d);
                s.status_tracked = counter(&v["buckets_tracked"]);
                s.reloads_ok = counter(&v["reloads"]["ok"]);
                s.reloads_failed = counter(&v["reloads"]["failed"]);
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
        match self.cli(&["stats", "--json"]) {
            Ok((v, d)) => {
                s.ms_stats = ms(d);
                s.tracked = counter(&v["buckets"]["tracked"]);
                s.capacity = counter(&v["buckets"]["capacity"]);
                s.new_buckets = counter(&v["global"]["new_buckets"]);
                s.bucket_errors = counter(&v["global"]["bucket_errors"]);
                s.evicted_full = counter(&v["global"]["evicted_full"]);
                s.evicted_lost = counter(&v["global"]["evicted_lost"]);
                if v["global"]["evicted_full"].is_null() || v["global"]["evicted_lost"].is_null() {
                    s.errors
                        .push("stats: no evicted_full or evicted_lost counter".to_string());
                }
                if let Some(rule) = v["rules"]
                    .as_array()
                    .and_then(|r| r.iter().find(|r| r["name"] == RULE))
                {
                    s.passed = counter(&rule["packets"]["passed"]);
                    s.dropped_rate = counter(&rule["packets"]["dropped_rate"]);
                    s.no_bucket = counter(&rule["packets"]["no_bucket"]);
                }
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
        match self.cli(&["top", "-n", "5", "--interval-ms", "500", "--json"]) {
            Ok((v, d)) => {
                s.ms_top = ms(d);
                s.top_active = counter(&v["active"]);
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
        match self.cli(&["explain", &POLITE.to_string(), "--json"]) {
            Ok((v, d)) => {
                s.ms_explain = ms(d);
                let b = &v["bucket"];
                s.polite_bucket_passed = b["passed"].as_u64();
                s.polite_bucket_dropped = b["dropped"].as_u64();
                s.polite_bucket_age_secs = b["age_secs"].as_f64();
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
        match self.metrics() {
            Ok((text, d)) => {
                s.ms_metrics = ms(d);
                s.metrics_new_buckets = metric(&text, "ratelimit_new_buckets_total").unwrap_or(0);
                s.metrics_tracked = metric(&text, "ratelimit_buckets_tracked").unwrap_or(0);
                s.metrics_evicted_full = metric(&text, EVICTIONS_FULL).unwrap_or(0);
                s.metrics_evicted_lost = metric(&text, EVICTIONS_LOST).unwrap_or(0);
                if metric(&text, EVICTIONS_FULL).is_none() {
                    s.errors.push(format!("metrics: no {EVICTIONS_FULL}"));
                }
                if metric(&text, "ratelimit_new_buckets_total").is_none() {
                    s.errors
                        .push("metrics: no ratelimit_new_buckets_total".to_string());
                }
            }
            Err(e) => s.errors.push(format!("metrics: {e:#}")),
        }
        for e in &s.errors {
            eprintln!("    soak: {e}");
        }
        Ok(s)
    }

    /// Makes the agent reload its (unchanged) config `way`, and waits (up to 30 s) for its log to
    /// say so.
    pub(super) fn reload(&self, agent: &mut AgentProcess, way: Reload, n: u64) -> Result<Value> {
        let reloaded = |log: &str| log.lines().filter(|l| logs_a_reload(l)).count();
        let before = reloaded(&agent.log());
        let t0 = Instant::now();
        let mut error = None;
        match way {
            Reload::File => {
                let path = agent.config_path();
                let text = fs::read_to_string(path)?;
                let mut new: String = text
                    .lines()
                    .filter(|l| !l.starts_with("# soak reload"))
                    .fold(String::new(), |mut acc, l| {
                        let _ = writeln!(acc, "{l}");
                        acc
                    });
                let _ = writeln!(new, "# soak reload {n}: rules unchanged");
                let tmp = path.with_extension("toml.new");
                fs::write(&tmp, new)?;
                fs::rename(&tmp, path)?;
            }
            Reload::Sighup => {
                let pid = agent_pid(agent.config_path())?;
                // SAFETY: kill has no memory-safety preconditions.
                if unsafe { libc::kill(libc::pid_t::try_from(pid)?, libc::SIGHUP) } != 0 {
                    error = Some(format!("SIGHUP: {}", std::io::Error::last_os_error()));
                }
            }
            Reload::Cli => {
                if let Err(e) = self.cli(&["rules", "reload", "--json"]) {
                    error = Some(format!("{e:#}"));
                }
            }
        }
        let mut done = false;
        while error.is_none() && t0.elapsed() < Duration::from_secs(30) {
            if reloaded(&agent.log()) > before {
                done = true;
                break;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let secs = t0.elapsed().as_secs_f64();
        if !done && error.is_none() {
            error = Some("the agent did not log a reload within 30 s".into());
        }
        if let Some(e) = &error {
            eprintln!("    soak: reload by {}: {e}", way.name());
        } else {
            eprintln!(
                "    soak: reloaded by {} in {:.0} ms",
                way.name(),
                secs * 1000.0
            );
        }
        Ok(json!({ "n": n, "way": way.name(), "ok": done, "seconds": secs, "error": error }))
    }
}

/// `ratelimit_bucket_evictions_total` of a full bucket, as the metrics name it.
pub(super) const EVICTIONS_FULL: &str = "ratelimit_bucket_evictions_total{state=\"full\"}";
/// ... and of a bucket in debt.
pub(super) const EVICTIONS_LOST: &str = "ratelimit_bucket_evictions_total{state=\"lost\"}";

/// A counter from a JSON answer (0 if absent).
pub(super) fn counter(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// The value of an unlabelled metric in an OpenMetrics text.
pub(super) fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.strip_prefix(' ')?;
        rest.split_whitespace()
            .next()?
            .parse::<f64>()
            .ok()
            .map(|v| {
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "counters and gauges of whole numbers"
                )]
                let v = v as u64;
                v
            })
    })
}

/// CPU time of process `pid`, user and system, threads that have exited included, in ns
/// (/proc/PID/stat; clock-tick resolution, fine over a sample interval). Summing the live threads'
/// schedstat, as the bench's short windows do, would lose the time of the agent's blocking-pool
/// threads when they exit.
pub(super) fn cpu_time_ns(pid: u32) -> Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) in parentheses: field 3 (state) is
    // the first; utime and stime are fields 14 and 15.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("no ')' in /proc/PID/stat")?;
    let fields: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let tick = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&t| t > 0)
        .unwrap_or(100);
    Ok(fields.iter().sum::<u64>() * 1_000_000_000 / tick)
}

/// Whether an agent's log line is its reload's (`agent::reload`: "reloaded", under the agent's
/// own modules, whichever of them logs it).
fn logs_a_reload(line: &str) -> bool {
    line.contains(" ratelimit::agent") && line.contains(": reloaded")
}

#[cfg(test)]
mod tests {
    use super::logs_a_reload;

    /// The agent's reload line as its log writes it, and lines that are not it.
    #[test]
    fn a_reload_is_read_from_the_agents_log() {
        assert!(logs_a_reload(
            "2026-12-02T15:20:47.1Z  INFO ratelimit::agent::reload: reloaded rules=3"
        ));
        assert!(logs_a_reload(
            "2026-12-02T15:20:47.1Z  INFO ratelimit::agent: reloaded rules=3"
        ));
        assert!(!logs_a_reload(
            "2026-12-02T15:20:47.1Z  INFO ratelimit::api: POST /v1/reload"
        ));
        assert!(!logs_a_reload(
            "2026-12-02T15:20:47.1Z  WARN ratelimit::agent::reload: reload failed: bad line 3"
        ));
    }
}
