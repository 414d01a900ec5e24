//! What learning costs (`ratelimit suggest`, issue #39): two real agents (release build) side by
//! side, each attached to a veth of its own namespace, each with a store of 1,048,576 records
//! filled from user space with live buckets of its rule (as the XDP program would for a million
//! sources, see `tests/tests/e2e_scale.rs`); one learns (the default), the other runs with
//! `[agent] learn = false`. A writer advances every bucket's packet counters once a second, by a
//! rate of its own, so that the learner follows a million sources that send. Over the same
//! windows: each agent's CPU (% of one core, every thread) and its VmRSS and RssAnon at the
//! window's end; the learning agent's figures against the other's, as ratios. Both agents
//! run the census (a walk of the store for `status` and the metrics) alike: the difference is
//! the learner's walk, its followed set and its sketches.

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use ratelimit::maps::PinnedMaps;
use ratelimit_testbed::{veth_pair, AgentProcess, Netns};
use serde_json::json;

use crate::{
    agent::{agent_pid, cpu_ns, rss_kib, vm_field},
    report::{Figure, Report},
    session::Options,
};

const SECTION: &str = "Learning (suggest): agent with 1M tracked sources, learning vs not";
/// Sources (records filled): the default store's capacity.
const SOURCES: u32 = 1 << 20;
const RULE: &str = "many";
/// Shortest sampling window: the learner walks at most once a second, paced to a tenth of a
/// core, so a shorter window would catch one walk or none.
const MIN_WINDOW: Duration = Duration::from_secs(5);

/// One agent of the pair, in its own namespace (the peer end of its veth in another).
struct Side {
    agent: AgentProcess,
    pid: u32,
    _ns: Netns,
    _peer: Netns,
}

fn side(tag: &str, learn: bool) -> Result<Side> {
    let ns = Netns::new(&format!("rl-bl-{tag}"))?;
    let peer = Netns::new(&format!("rl-bl-{tag}-p"))?;
    let (_, iface) = veth_pair(&peer, &ns, "bl")?;
    let config = format!(
        "[agent]\ninterfaces = [\"{iface}\"]\nmax_buckets = {SOURCES}\nlearn = {learn}\n\n\
         [[rule]]\nname = \"{RULE}\"\nsource = \"0.0.0.0/0\"\nrate = 1000\nburst = 1000\n"
    );
    let agent = AgentProcess::start(&ns, &config, &[])?;
    let pid = agent_pid(agent.config_path())?;
    Ok(Side {
        agent,
        pid,
        _ns: ns,
        _peer: peer,
    })
}

/// Packets a second source `i` sends: 1 to about 1,000, log-spread (a 32-bit mix of `i`).
fn rate_of(i: u32) -> u32 {
    let mut x = i.wrapping_mul(0x9e37_79b9);
    x ^= x >> 15;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    (1 << (x % 11)) | ((x >> 24) % 7)
}

/// Writes a live bucket of the agent's rule into every record of its store (source 10.x.y.z
/// for record x.y.z, no packets counted yet), as the program would for a million sources.
fn fill(pin: &Path) -> Result<()> {
    let written = ratelimit_testbed::fill::fill_store(pin, RULE, SOURCES, 0)?;
    if written < SOURCES {
        bail!("a store of {written} records");
    }
    Ok(())
}

/// Stops the sender when dropped, on every way out of [`run`].
struct Stop(Arc<AtomicBool>);

impl Drop for Stop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Advances every bucket's counters by its rate, once a second, until `stop`.
fn sender(pins: Vec<PathBuf>, stop: Arc<AtomicBool>) -> thread::JoinHandle<Result<()>> {
    thread::spawn(move || {
        let maps = pins
            .iter()
            .map(|p| PinnedMaps::open(p))
            .collect::<Result<Vec<_>, _>>()?;
        while !stop.load(Ordering::Relaxed) {
            let began = Instant::now();
            for m in &maps {
                let store = m.store();
                for i in 0..SOURCES {
                    let mut b = store.get(i);
                    b.passed_pkts = b.passed_pkts.wrapping_add(rate_of(i));
                    // A record the agent's own write holds at that instant keeps its count.
                    let _ = store.install(i, b.header(), &b);
                }
            }
            thread::sleep(Duration::from_secs(1).saturating_sub(began.elapsed()));
        }
        Ok(())
    })
}

/// CPU (% of a core) of each pid over `window`, and (VmRSS, RssAnon) in MiB at its end.
#[expect(clippy::cast_precision_loss, reason = "nanoseconds and KiB")]
fn window(pids: [u32; 2], window: Duration) -> Result<[(f64, f64, f64); 2]> {
    let c0 = [cpu_ns(pids[0])?, cpu_ns(pids[1])?];
    let t0 = Instant::now();
    thread::sleep(window);
    let secs = t0.elapsed().as_secs_f64();
    let one = |k: usize| -> Result<(f64, f64, f64)> {
        Ok((
            (cpu_ns(pids[k])? - c0[k]) as f64 / 1e9 / secs * 100.0,
            rss_kib(pids[k])? as f64 / 1024.0,
            vm_field(pids[k], "RssAnon:")? as f64 / 1024.0,
        ))
    };
    Ok([one(0)?, one(1)?])
}

/// The two agents' CPU and memory with a million sources, learning and not.
pub fn run(report: &mut Report, opts: &Options) -> Result<()> {
    crate::session::announce("the learner's CPU and memory with 1M tracked sources, on and off");
    let on = side("on", true)?;
    let off = side("off", false)?;
    fill(on.agent.pin_path())?;
    fill(off.agent.pin_path())?;
    let stop = Stop(Arc::new(AtomicBool::new(false)));
    let send = sender(
        vec![on.agent.pin_path().into(), off.agent.pin_path().into()],
        stop.0.clone(),
    );
    let span = opts.e2e_run.max(MIN_WINDOW);
    // Let the learner meet the million buckets (its first walks thin the followed set).
    thread::sleep(span);
    let mut figures: [Vec<f64>; 6] = Default::default();
    for _ in 0..opts.runs {
        crate::session::check_interrupted()?;
        let [a, b] = window([on.pid, off.pid], span)?;
        for (k, v) in [a.0, b.0, a.1, b.1, a.2, b.2].into_iter().enumerate() {
            figures[k].push(v);
        }
    }
    // What the learner saw: one proposal for the rule, over its sampled sources scaled back up.
    let learned = on.agent.cli_json(&["suggest", "--rule", RULE]);
    drop(stop);
    send.join()
        .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
    let sources = learned[0]["sources"].as_u64().unwrap_or(0);
    if sources < u64::from(SOURCES) / 2 {
        bail!("the learner saw {sources} sources of {SOURCES}: {learned}");
    }
    let detail = json!({
        "sources_filled": SOURCES,
        "window_seconds": span.as_secs_f64(),
        "learned_sources": sources,
        "learned_proposal": learned[0]["proposed"],
        "pids": [on.pid, off.pid],
    });
    on.agent.stop()?;
    off.agent.stop()?;
    let [cpu_on, cpu_off, rss_on, rss_off, anon_on, anon_off] = figures;
    for (key, label, unit, runs, baseline) in [
        (
            "learn.off.cpu",
            "agent CPU, learn = false",
            "% core",
            cpu_off,
            None,
        ),
        (
            "learn.on.cpu",
            "agent CPU, learning",
            "% core",
            cpu_on,
            Some("learn.off.cpu"),
        ),
        (
            "learn.off.rss",
            "agent VmRSS, learn = false",
            "MiB",
            rss_off,
            None,
        ),
        (
            "learn.on.rss",
            "agent VmRSS, learning",
            "MiB",
            rss_on,
            Some("learn.off.rss"),
        ),
        (
            "learn.off.anon",
            "agent RssAnon (heap), learn = false",
            "MiB",
            anon_off,
            None,
        ),
        (
            "learn.on.anon",
            "agent RssAnon (heap), learning",
            "MiB",
            anon_on,
            Some("learn.off.anon"),
        ),
    ] {
        report.add(Figure {
            key: key.into(),
            section: SECTION,
            label: label.into(),
            unit,
            runs,
            baseline: baseline.map(Into::into),
            detail: detail.clone(),
        });
    }
    Ok(())
}
