//! The test binaries of `cargo xtask test`, run in two lanes at once. Most of the tests' time is
//! waiting: agents keeping their rounds, floods sent at a rate for seconds, gossip converging.
//! `cargo test` runs its binaries one after another; here one lane runs the binaries whose
//! figures depend on how promptly agents and senders get the CPU (every `e2e_cluster*`: one
//! after another, as `cargo test` would, with its tests two at a time; and `buckets_two_cpus`,
//! which keeps both cores busy), and the other runs the rest beside them, one test at a time, so
//! that they take about one core of the two. On 2 cores the binaries took 25 minutes one after
//! another and 19 in the two lanes (the cluster's 18.7, the other 14.2; docs/journal.md, "CI's
//! test binaries in two lanes"). A binary's output is printed whole when it ends, under cargo's
//! own `Running` line.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::Mutex,
    thread,
    time::Instant,
};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::cmd;

/// A test binary, as `cargo test --no-run` built it.
#[derive(Debug)]
pub struct Binary {
    /// The target's name (`e2e_cluster`, `ratelimit_common`).
    pub name: String,
    /// Its source, relative to its package (`tests/e2e_cluster/main.rs`), for cargo's line.
    pub src: String,
    /// The package's directory: cargo runs a test binary there, with `CARGO_MANIFEST_DIR` set.
    pub package_dir: PathBuf,
    /// The executable.
    pub exe: PathBuf,
}

/// Binaries that run in the lane of their own: the cluster's, whose bounds rest on several
/// agents' rounds and the senders' pacing (each reckons its own lag, and was tuned with at most
/// a busy loop beside it). Two of them at once would be two such loads on two cores. And
/// `buckets_two_cpus`, whose tests keep both cores busy for seconds (a thread pinned to each,
/// running the program in a loop): more than the busy loop the cluster's were tuned beside
/// (docs/journal.md, "A cluster scenario beside two busy cores").
fn runs_alone(name: &str) -> bool {
    name.starts_with("e2e_cluster") || name == "buckets_two_cpus"
}

/// Builds every test binary of the workspace's default members (`cargo test --no-run`) and
/// lists them in cargo's order.
pub fn build() -> Result<Vec<Binary>> {
    let mut cargo = cmd::cargo();
    cargo.args([
        "test",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    cmd::announce("Building the unit and integration tests (cargo test --no-run)");
    eprintln!("    $ {}", cmd::display(&cargo));
    let out = cargo
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("could not start `cargo test --no-run`")?;
    if !out.status.success() {
        bail!("building the tests failed ({})", out.status);
    }
    parse_artifacts(&String::from_utf8_lossy(&out.stdout))
}

/// The test executables in cargo's JSON messages.
fn parse_artifacts(json_lines: &str) -> Result<Vec<Binary>> {
    let mut binaries = Vec::new();
    for line in json_lines.lines().filter(|l| l.starts_with('{')) {
        let msg: Value = serde_json::from_str(line).context("a message of cargo's")?;
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let manifest = msg["manifest_path"]
            .as_str()
            .context("an artifact without its manifest_path")?;
        let package_dir = Path::new(manifest)
            .parent()
            .context("a manifest_path without a directory")?
            .to_path_buf();
        let src_path = msg["target"]["src_path"].as_str().unwrap_or_default();
        let src = Path::new(src_path)
            .strip_prefix(&package_dir)
            .map_or_else(|_| src_path.to_string(), |p| p.display().to_string());
        binaries.push(Binary {
            name: msg["target"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            src,
            package_dir,
            exe: PathBuf::from(exe),
        });
    }
    if binaries.is_empty() {
        bail!("`cargo test --no-run` named no test binary");
    }
    // Cargo's messages come in the order the builds finished; run in cargo's own order.
    binaries.sort_by(|a, b| (&a.package_dir, &a.name).cmp(&(&b.package_dir, &b.name)));
    Ok(binaries)
}

/// How one binary went.
struct Outcome {
    name: String,
    ok: bool,
    secs: f64,
}

/// Runs `binaries` in the two lanes and prints each one's output as it ends; fails if any of
/// them failed, naming them. `ip netns add` mounts /run/netns on its first use, and two first
/// uses at once can race (the test bed serialises them within a process only), so one
/// namespace is made and removed before the lanes start.
pub fn run(binaries: &[Binary]) -> Result<()> {
    warm_netns()?;
    let (alone, beside): (Vec<_>, Vec<_>) = binaries.iter().partition(|b| runs_alone(&b.name));
    cmd::announce(&format!(
        "Running {} test binaries in two lanes: {} one after another, {} beside them one test at a time",
        binaries.len(),
        alone.len(),
        beside.len()
    ));
    let start = Instant::now();
    let printing = Mutex::new(Vec::new());
    thread::scope(|s| {
        s.spawn(|| lane(&alone, None, &printing));
        s.spawn(|| lane(&beside, Some(1), &printing));
    });
    let outcomes = printing.into_inner().unwrap_or_else(|e| e.into_inner());
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok).collect();
    eprintln!(
        "==> {} test binaries in {:.1} s, the longest: {}",
        outcomes.len(),
        start.elapsed().as_secs_f64(),
        longest(&outcomes)
    );
    if !failed.is_empty() {
        let names: Vec<String> = failed
            .iter()
            .map(|o| format!("{} ({:.1} s)", o.name, o.secs))
            .collect();
        bail!(
            "tests failed in {}: see their `test result:` lines and failures above; one binary \
             again: `cargo xtask test -- -p PACKAGE --test NAME` (`--lib` for unit tests)",
            names.join(", ")
        );
    }
    Ok(())
}

/// Runs one lane's binaries one after another; `threads` sets `RUST_TEST_THREADS`.
fn lane(binaries: &[&Binary], threads: Option<u32>, printing: &Mutex<Vec<Outcome>>) {
    for b in binaries {
        let started = Instant::now();
        let mut command = Command::new(&b.exe);
        command
            .current_dir(&b.package_dir)
            .env("CARGO_MANIFEST_DIR", &b.package_dir);
        if let Some(n) = threads {
            command.env("RUST_TEST_THREADS", n.to_string());
        }
        let result = command.output();
        let secs = started.elapsed().as_secs_f64();
        let mut done = printing.lock().unwrap_or_else(|e| e.into_inner());
        let ok = report(b, &result, secs);
        done.push(Outcome {
            name: b.name.clone(),
            ok,
            secs,
        });
    }
}

/// Prints a binary's output under cargo's line for it; whether it passed.
fn report(b: &Binary, result: &std::io::Result<Output>, secs: f64) -> bool {
    println!("     Running {} ({}) [{secs:.1} s]", b.src, b.exe.display());
    match result {
        Ok(out) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            eprint!("{}", String::from_utf8_lossy(&out.stderr));
            if !out.status.success() {
                println!("error: {} failed ({})", b.name, out.status);
            }
            out.status.success()
        }
        Err(e) => {
            println!("error: could not start {}: {e}", b.exe.display());
            false
        }
    }
}

/// The three binaries that took longest, for the summary.
fn longest(outcomes: &[Outcome]) -> String {
    let mut by_time: Vec<&Outcome> = outcomes.iter().collect();
    by_time.sort_by(|a, b| b.secs.total_cmp(&a.secs));
    by_time
        .iter()
        .take(3)
        .map(|o| format!("{} {:.0} s", o.name, o.secs))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Makes and removes one network namespace, so that /run/netns is mounted before two test
/// processes can make their first at once.
fn warm_netns() -> Result<()> {
    let name = format!("rl-lanes-{}", std::process::id());
    for verb in ["add", "del"] {
        let mut ip = Command::new("ip");
        ip.args(["netns", verb, &name]);
        match cmd::output(&mut ip) {
            Some((status, _, _)) if status.success() => {}
            Some((status, _, stderr)) => {
                bail!(
                    "`{}` failed ({status}): {}",
                    cmd::display(&ip),
                    stderr.trim()
                );
            }
            None => bail!("`ip` is missing: the tests need iproute2 (cargo xtask setup)"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cargos_messages_give_the_test_binaries_and_where_they_run() {
        let lines = [
            r#"{"reason":"compiler-artifact","package_id":"p","manifest_path":"/w/tests/Cargo.toml","target":{"kind":["test"],"name":"e2e_cluster","src_path":"/w/tests/tests/e2e_cluster/main.rs"},"profile":{"test":true},"executable":"/w/target/debug/deps/e2e_cluster-0a"}"#,
            r#"{"reason":"compiler-artifact","package_id":"q","manifest_path":"/w/common/Cargo.toml","target":{"kind":["lib"],"name":"common","src_path":"/w/common/src/lib.rs"},"profile":{"test":false},"executable":null}"#,
            r#"{"reason":"compiler-artifact","package_id":"q","manifest_path":"/w/common/Cargo.toml","target":{"kind":["lib"],"name":"common","src_path":"/w/common/src/lib.rs"},"profile":{"test":true},"executable":"/w/target/debug/deps/common-1b"}"#,
            r#"{"reason":"build-finished","success":true}"#,
        ];
        let got = parse_artifacts(&lines.join("\n")).unwrap();
        assert_eq!(got.len(), 2);
        // In cargo's order: by package, then name.
        assert_eq!(got[0].exe, PathBuf::from("/w/target/debug/deps/common-1b"));
        assert_eq!(got[1].name, "e2e_cluster");
        assert_eq!(got[1].src, "tests/e2e_cluster/main.rs");
        assert_eq!(got[1].package_dir, PathBuf::from("/w/tests"));
        assert!(runs_alone("e2e_cluster_bursty") && runs_alone("e2e_cluster"));
        assert!(runs_alone("buckets_two_cpus"));
        assert!(!runs_alone("e2e_api") && !runs_alone("buckets"));
        assert!(parse_artifacts(lines[3]).is_err());
    }
}
