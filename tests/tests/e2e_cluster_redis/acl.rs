//! Through a Redis Cluster as an ACL user, with the password read from `redis_password_file`:
//! wrong for one host from the start, then right, then changed at the server.

use std::os::unix::fs::PermissionsExt as _;
use std::time::{Duration, Instant};

use ratelimit_testbed::{
    cluster_net::{counted_peers, status, ClusterNet, Samples, Split},
    require_root, AgentProcess,
};
use serde_json::Value;

use crate::{all_connected, serial, store, Bed, ACCURACY, BURST, RATE, SAMPLE, SYNC_MS};

const PASSWORD: &str = "e2e-s3cret-not-default";
const FIX_AT: f64 = 6.0;
const RUN: f64 = 20.0;

/// Through a Redis Cluster (one node serving every slot) as an ACL user, with the password from
/// `redis_password_file`: the agents find it is a cluster (status: mode `cluster`, 1 shard),
/// route each key's script by its hash tag, authenticate as that user, and share one budget
/// (0.95-1.05 x over 6 s or more; 2 hosts, 4,000 pps split 75/25).
///
/// h0's password file is wrong from the start: it runs, shows the store down with the server's
/// refusal and enforces alone at its whole rate (fail open, docs/cluster.md's "a host that
/// cannot reach the store enforces alone"), as h1 does. The right password written into the
/// file, h0 logs in by itself at its next attempt (the file is read at each one), within the
/// longest backoff, with no restart; then the two share one budget.
#[test]
fn hosts_share_one_budget_through_a_redis_cluster_as_an_acl_user() {
    require_root();
    let _serial = serial();
    let (bed, dir, pw) = start_with_h0s_password_wrong();
    let seen = flood_and_write_the_right_password(&bed, &pw);
    let fig = figures(&bed, &seen);
    assert_h0_failed_open_and_said_why(&fig, &seen);
    assert_logged_in_by_itself_and_one_budget_as_the_user(&bed, &fig, &seen);
    assert_a_password_changed_at_the_server_is_refused(&bed);

    let _ = std::fs::remove_dir_all(&dir);
    bed.teardown("rl-credisc");
}

/// A one-node Redis Cluster with the ACL user `ratelimit`, and two agents logging in as that
/// user, each with its own password file: h0's wrong, h1's right. Each agent is started without
/// waiting for it to count the other, as h0 never would. Returns the bed, the directory of the
/// password files, and the files (h0's first).
fn start_with_h0s_password_wrong() -> (Bed, std::path::PathBuf, Vec<std::path::PathBuf>) {
    let net = ClusterNet::new("rl-credisc", 2).unwrap();
    let redis = net
        .start_redis_with(&[
            "--cluster-enabled",
            "yes",
            "--user",
            "ratelimit",
            "on",
            &format!(">{PASSWORD}"),
            "~*",
            "&*",
            "+@all",
        ])
        .unwrap();
    let dir = std::env::temp_dir().join(format!("rl-credisc-pw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // h0's file holds a wrong password from the start, h1's the right one.
    let pw: Vec<std::path::PathBuf> = (0..2).map(|i| dir.join(format!("h{i}.password"))).collect();
    for (p, text) in pw.iter().zip(["not-the-password", PASSWORD]) {
        std::fs::write(p, format!("{text}\n")).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let url = redis.url();
    // Not `start_agents_with`, which waits until each counts the other: h0 never logs in.
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "small"
    )]
    let agents: Vec<AgentProcess> = net
        .hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let config = net
                .redis_config(i, RATE as u64, BURST, SYNC_MS, &url)
                .replace(
                    "[cluster]\n",
                    &format!(
                        "[cluster]\nredis_user = \"ratelimit\"\nredis_password_file = \"{}\"\n",
                        pw[i].display()
                    ),
                );
            AgentProcess::start_logging(&h.ns, &config, &[], "info").unwrap()
        })
        .collect();
    let receivers = net.receivers().unwrap();
    let bed = Bed {
        receivers,
        agents,
        redis,
        net,
        url,
    };
    (bed, dir, pw)
}

/// What [`flood_and_write_the_right_password`] saw.
struct Seen {
    samples: Samples,
    /// h0's status 1 s before the right password was written.
    refused: Value,
    /// When both agents were connected and counted each other (none if never).
    fixed: Option<f64>,
    /// Each agent's status at the end.
    statuses: Vec<Value>,
}

/// 4,000 pps split 75/25 for [`RUN`] s, sampled every [`SAMPLE`]: h0's status read 1 s before
/// [`FIX_AT`], the right password written into h0's file at [`FIX_AT`], then watched until both
/// agents are connected and count each other. Asserts nothing: the figures come first.
fn flood_and_write_the_right_password(bed: &Bed, pw: &[std::path::PathBuf]) -> Seen {
    let Bed {
        receivers,
        agents,
        net,
        ..
    } = bed;
    let start = Instant::now();
    let sender = net
        .flood(
            vec![Split {
                end: RUN,
                pps: 4000.0,
                weights: vec![75.0, 25.0],
            }],
            start,
        )
        .unwrap();
    let mut samples = Samples::default();
    samples.take_until(receivers, start, FIX_AT - 1.0, SAMPLE);
    let refused = status(&agents[0]).unwrap();
    samples.take_until(receivers, start, FIX_AT, SAMPLE);
    std::fs::write(&pw[0], format!("{PASSWORD}\n")).unwrap();
    let mut fixed: Option<f64> = None;
    loop {
        samples.take(receivers, start);
        let t = start.elapsed().as_secs_f64();
        if t >= RUN {
            break;
        }
        if fixed.is_none() && all_connected(agents) {
            fixed = Some(t);
        }
        std::thread::sleep(SAMPLE);
    }
    sender.join().unwrap();
    let statuses: Vec<Value> = agents.iter().map(|a| status(a).unwrap()).collect();
    Seen {
        samples,
        refused,
        fixed,
        statuses,
    }
}

/// The figures the assertions check, in budgets.
struct Figures {
    /// What each host admitted while h0's password was wrong.
    wrong: Vec<f64>,
    /// When both were connected (NaN if never).
    fixed: f64,
    /// What the two admitted from 2 s after that.
    ratio: f64,
}

/// Prints what each host admitted with h0's password wrong, when both were connected after the
/// right one was written and what they admitted then, and h0's store while refused; all before
/// any assertion, so a failing run shows them.
fn figures(bed: &Bed, seen: &Seen) -> Figures {
    let (url, samples, refused) = (&bed.url, &seen.samples, &seen.refused);
    let wrong: Vec<f64> = (0..2)
        .map(|h| samples.host_rate(h, 1.5, FIX_AT) / RATE)
        .collect();
    let fixed = seen.fixed.unwrap_or(f64::NAN);
    let ratio = samples.rate(fixed + 2.0, RUN) / RATE;
    println!(
        "\n2 hosts through a one-node Redis Cluster at {url} as user ratelimit, 4,000 pps 75/25: \
         h0 with a wrong password admitted {:.3} budgets and h1 {:.3} (1.5-{FIX_AT} s); the \
         right one written at {FIX_AT} s, both connected {:.1} s later; then {ratio:.3} budgets \
         over {:.1}-{RUN} s; per host [{:.0} {:.0}] pps",
        wrong[0],
        wrong[1],
        fixed - FIX_AT,
        fixed + 2.0,
        samples.host_rate(0, fixed + 2.0, RUN),
        samples.host_rate(1, fixed + 2.0, RUN)
    );
    println!("h0 with a wrong password: store {}", store(refused));
    Figures {
        wrong,
        fixed,
        ratio,
    }
}

/// The wrong password: h0 runs, enforces alone at the whole rate (fail open; with the budget
/// shared it would get 0.75), and names the refusal; h1, holding the key alone in the store,
/// its whole rate too.
fn assert_h0_failed_open_and_said_why(fig: &Figures, seen: &Seen) {
    let (wrong, refused) = (&fig.wrong, &seen.refused);
    assert_eq!(store(refused)["state"], "down", "{}", store(refused));
    assert!(
        store(refused)["last_error"]
            .as_str()
            .is_some_and(|e| e.to_ascii_lowercase().contains("pass")),
        "h0 does not say why it cannot log in: {}",
        store(refused)
    );
    assert!(
        wrong.iter().all(|&r| (0.9..=1.1).contains(&r)),
        "with h0's password wrong each host should admit its whole rate (0.9-1.1 budgets): \
         {wrong:.3?}"
    );
}

/// The right password written, h0 logs in by itself within 6 s, with no restart. Then both
/// show the store a cluster of 1 shard, connected, each counts the other, the two admit one
/// budget ([`ACCURACY`]), and Redis shows a client connected as the ACL user.
fn assert_logged_in_by_itself_and_one_budget_as_the_user(bed: &Bed, fig: &Figures, seen: &Seen) {
    let (fixed, ratio, redis) = (fig.fixed, fig.ratio, &bed.redis);
    // The longest backoff (5 s), an attempt, a round for h1 to read h0's field, one late.
    assert!(
        fixed - FIX_AT <= 6.0,
        "h0 logged in {:.1} s after the right password was written, want within the longest \
         backoff (5 s), an attempt and a round or two",
        fixed - FIX_AT
    );
    for (i, st) in seen.statuses.iter().enumerate() {
        println!("h{i}: store {}", store(st));
        let s = store(st);
        assert_eq!(
            (
                s["mode"].as_str(),
                s["shards"].as_u64(),
                s["state"].as_str()
            ),
            (Some("cluster"), Some(1), Some("connected")),
            "h{i}: {s}"
        );
        assert_eq!(counted_peers(st).len(), 1, "h{i}: {}", st["cluster"]);
    }
    assert!(
        ratio >= ACCURACY.0 && ratio <= ACCURACY.1,
        "through the Redis Cluster the two hosts admitted {ratio:.3} budgets, want {ACCURACY:?}"
    );
    let clients = redis.cli(&["CLIENT", "LIST"]).unwrap();
    assert!(
        clients.contains("user=ratelimit"),
        "no agent connected as the ACL user: {clients}"
    );
}

/// The password changed under the agents (and their connections closed): each fails to log
/// in again and shows the store down with the server's refusal, 1.5 s after.
fn assert_a_password_changed_at_the_server_is_refused(bed: &Bed) {
    let Bed { agents, redis, .. } = bed;
    redis
        .cli(&["ACL", "SETUSER", "ratelimit", "resetpass", ">another-one"])
        .unwrap();
    redis.cli(&["CLIENT", "KILL", "USER", "ratelimit"]).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    for (i, a) in agents.iter().enumerate() {
        let st = status(a).unwrap();
        let s = store(&st);
        println!("h{i} with a wrong password: store {s}");
        assert_eq!(s["state"], "down", "h{i}: {s}");
        assert!(
            s["last_error"]
                .as_str()
                .is_some_and(|e| e.to_ascii_lowercase().contains("pass")),
            "h{i} does not say why it cannot log in: {s}"
        );
    }
}
