//! What one host withholds for its peer, the gossip link's bytes and crafted datagrams, each
//! counted exactly and alike in `status`, `peers` and the metrics.

use std::thread;
use std::time::{Duration, Instant};

use crate::{
    crafter, flood_over, metric, net, peer_at, start_agents, tx_bytes, CLUSTER_ID, FLOOD,
    FRAME_OVERHEAD,
};
use ratelimit::cluster::key::ClusterKey;
use ratelimit::cluster::wire::Codec;
use ratelimit_testbed::cluster::{
    cli, cluster, counter, peers, scrape, stop_agents, unix_ms, wait_for,
};
use ratelimit_testbed::cluster_net::{gossip_addr, ClusterNet, SECRET};
use ratelimit_testbed::AgentProcess;
use serde_json::{json, Value};

/// Gossip bytes, the refill withheld for a peer's share, crafted datagrams and failed sends,
/// each counted exactly and alike in `status`, `peers` and the metrics.
#[test]
fn charges_gossip_bytes_and_rejections_are_counted_exactly() {
    let net = net("cnt", 2);
    let agents = start_agents(&net, 2, 100, 1000);
    let (h0, h1) = (&agents[0], &agents[1]);

    gossip_bytes_out_are_what_left_the_link(&net, h0);
    let flooded = flood_both_hosts(&net, h0);
    holders_show_demand_and_shares(&flooded);
    let pkts = withheld_agrees_everywhere(&net, h0, h1, &flooded);
    rejections_are_counted_by_reason(&net, h0, pkts);
    failed_sends_are_counted(&net, h0, h1);

    stop_agents(agents);
}

/// `cluster_bytes`: what h0 says it sent is what left its gossip link. A snapshot of the
/// agent's counters is taken only if the link counter did not move across it.
fn gossip_bytes_out_are_what_left_the_link(net: &ClusterNet, h0: &AgentProcess) {
    let snapshot = || {
        wait_for(
            "a still moment on the gossip link",
            Duration::from_secs(10),
            || {
                let before = tx_bytes(&net.hosts[0].ns, &net.hosts[0].gossip_if);
                let c = cluster(h0);
                let after = tx_bytes(&net.hosts[0].ns, &net.hosts[0].gossip_if);
                (before == after)
                    .then(|| (after, counter(&c, "bytes_out"), counter(&c, "messages_out")))
            },
        )
    };
    let (l0, b0, m0) = snapshot();
    let t0 = Instant::now();
    thread::sleep(Duration::from_secs(3));
    let (l1, b1, m1) = snapshot();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "gossip out of h0 (2 hosts, 100 ms, idle): {} datagrams, {} B in {secs:.1} s = {:.0} B/s; \
         link {} B",
        m1 - m0,
        b1 - b0,
        (b1 - b0) as f64 / secs,
        l1 - l0
    );
    assert!(m1 > m0, "h0 sent no gossip");
    assert_eq!(
        l1 - l0,
        (b1 - b0) + FRAME_OVERHEAD * (m1 - m0),
        "gossip link bytes vs the agent's bytes_out and messages_out"
    );
    let before = counter(&cluster(h0), "bytes_out");
    let body = scrape(&net.hosts[0].ns);
    let after = counter(&cluster(h0), "bytes_out");
    let scraped = metric(&body, r#"ratelimit_cluster_bytes_total{direction="out"}"#);
    assert!(
        (before..=after).contains(&scraped),
        "metric cluster_bytes out {scraped} not between the status reads {before}..{after}"
    );
}

/// One source flooding both hosts, and what h0 showed meanwhile.
struct Flooded {
    began: Instant,
    sent: [u64; 2],
    admitted: [u64; 2],
    /// h0's `peers --json` once it named both holders of the source's key.
    shown: Value,
    /// The source's key in it.
    key: Value,
    /// The `peers` table of that moment.
    table: String,
    /// The metrics of that moment.
    body: String,
}

/// Charges: one source floods both hosts (1,500 pps each, 3 x the budget): h0 gives its
/// bucket its share and withholds the rest of its refill for h1's.
fn flood_both_hosts(net: &ClusterNet, h0: &AgentProcess) -> Flooded {
    let c0 = cluster(h0);
    assert_eq!(counter(&c0, "charged_pkts"), 0, "{c0}");
    let began = Instant::now();
    let flood_key = format!("{FLOOD}/32");
    let (((sent0, admitted0), (sent1, admitted1)), (shown, key, table, body)) =
        thread::scope(|s| {
            let a = s.spawn(|| flood_over(net, 0, 1500, Duration::from_secs(2)));
            let b = s.spawn(|| flood_over(net, 1, 1500, Duration::from_secs(2)));
            // While both hosts flood: h0's `peers --json` once it names both holders of the
            // source's key, with the table and the metrics of that moment.
            let shown = wait_for(
                "h0's peers to name both holders of the flooded key",
                Duration::from_millis(1900),
                || {
                    let v: Value = serde_json::from_str(&cli(h0, &["peers", "--json"])).unwrap();
                    let key = v["keys"]
                        .as_array()?
                        .iter()
                        .find(|k| k["rule"] == "cl" && k["key"] == flood_key.as_str())?
                        .clone();
                    (key["holders"].as_array()?.len() == 2).then(|| {
                        let table = cli(h0, &["peers"]);
                        (v, key, table, scrape(&net.hosts[0].ns))
                    })
                },
            );
            ((a.join().unwrap(), b.join().unwrap()), shown)
        });
    Flooded {
        began,
        sent: [sent0, sent1],
        admitted: [admitted0, admitted1],
        shown,
        key,
        table,
        body,
    }
}

/// Why the source is limited: h0's `peers` shows its key held by both hosts, each with its
/// demand and share (h0 first), the shares adding up to the whole budget; the table and the
/// metrics show the same.
fn holders_show_demand_and_shares(flooded: &Flooded) {
    let Flooded {
        shown,
        key,
        table,
        body,
        ..
    } = flooded;
    let flood_key = format!("{FLOOD}/32");
    println!("h0's peers while the source floods both hosts: {key:#}\n{table}");
    let holders = key["holders"].as_array().unwrap();
    let h1_id = &peer_at(shown, gossip_addr(1))[0];
    assert_eq!(
        (
            &key["limit"],
            &key["hosts"],
            &holders[0]["node_id"],
            &holders[0]["generation"]
        ),
        (
            &json!(1),
            &json!(2),
            &shown["node_id"],
            &shown["generation"]
        ),
        "{key:#}"
    );
    assert_eq!(
        (&holders[1]["node_id"], &holders[1]["generation"]),
        (&h1_id["node_id"], &h1_id["generation"]),
        "{key:#}"
    );
    let figure = |h: &Value, f: &str| h[f].as_f64().unwrap_or_else(|| panic!("{f}: {key:#}"));
    assert!(figure(&holders[0], "demand_pps") > 0.0, "{key:#}");
    let total: f64 = holders.iter().map(|h| figure(h, "share")).sum();
    assert!(
        (total - 1.0).abs() <= 0.1,
        "the holders' shares add up to {total}: {key:#}"
    );
    let demand: f64 = holders.iter().map(|h| figure(h, "demand_pps")).sum();
    assert!(
        (figure(key, "demand_pps") - demand).abs() < 1e-6,
        "the cluster's demand is the holders': {key:#}"
    );
    let me = shown["node_id"].as_str().unwrap();
    assert!(
        table.contains(&flood_key) && table.contains(&format!("{me} (this host)")),
        "peers table does not show the key's holders:\n{table}"
    );
    for holder in [me, h1_id["node_id"].as_str().unwrap()] {
        let series = format!(
            "ratelimit_cluster_key_share{{rule=\"cl\",limit=\"1\",key=\"{flood_key}\",holder=\"{holder}\"}} "
        );
        assert!(body.contains(&series), "no {series} in:\n{body}");
    }
}

/// Once neither host has demand, nothing more is withheld; the total, h1's part (h0's only
/// peer: all of it), the table and the metric agree exactly; no byte limit, no bytes withheld.
/// Returns the packets withheld.
fn withheld_agrees_everywhere(
    net: &ClusterNet,
    h0: &AgentProcess,
    h1: &AgentProcess,
    flooded: &Flooded,
) -> u64 {
    let Flooded {
        began,
        sent: [sent0, sent1],
        admitted: [admitted0, admitted1],
        ..
    } = *flooded;
    let c = wait_for("h0's withholding to stop", Duration::from_secs(10), || {
        let c = cluster(h0);
        thread::sleep(Duration::from_millis(500));
        (counter(&cluster(h0), "charged_pkts") == counter(&c, "charged_pkts")).then_some(c)
    });
    let span = began.elapsed().as_secs_f64();
    let pkts = counter(&c, "charged_pkts");
    println!(
        "sent {sent0} to h0, {sent1} to h1; admitted {admitted0} at h0, {admitted1} at h1; h0 \
         withheld {pkts} packets of refill over {span:.1} s"
    );
    assert!(pkts > 0, "h0 withheld nothing for h1's share: {c}");
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a few thousand"
    )]
    let most = (1000.0 * span) as u64;
    assert!(
        pkts <= most,
        "h0 withheld {pkts} packets, more than its whole refill over {span:.1} s ({most})"
    );
    assert!(
        admitted0 + admitted1 < sent0 + sent1,
        "nothing was limited: the test did not load the budget"
    );
    assert_eq!(counter(&c, "charged_bytes"), 0, "no byte limit: {c}");
    assert_eq!(counter(&c, "charges_clamped"), 0, "a round ran late: {c}");
    let p = peer_at(&c, gossip_addr(1));
    assert_eq!(p.len(), 1, "{c}");
    assert_eq!(
        (
            p[0]["charged_pkts"].as_u64(),
            p[0]["charged_bytes"].as_u64()
        ),
        (Some(pkts), Some(0))
    );
    let body = scrape(&net.hosts[0].ns);
    assert_eq!(
        metric(&body, "ratelimit_cluster_charged_packets_total"),
        pkts
    );
    assert_eq!(metric(&body, "ratelimit_cluster_charged_bytes_total"), 0);
    assert_eq!(metric(&body, "ratelimit_cluster_charges_clamped_total"), 0);
    let c1 = cluster(h1);
    assert_eq!(counter(&c1, "keys_published"), 1, "{c1}");
    assert_eq!(
        metric(
            &scrape(&net.hosts[1].ns),
            "ratelimit_cluster_keys_published"
        ),
        1
    );
    let table = cli(h0, &["peers"]);
    assert!(
        table.contains(&pkts.to_string()),
        "peers table does not show the charge:\n{table}"
    );
    pkts
}

/// Rejections, by reason, exactly: junk (malformed), sealed with the cluster key but a
/// minute old or ahead, or replayed (stale), sealed with another key, sealed for another host
/// (h1) or sealed from another source address than it came from (auth).
/// Nothing of it reaches the cluster's state: `pkts` stays what was withheld.
fn rejections_are_counted_by_reason(net: &ClusterNet, h0: &AgentProcess, pkts: u64) {
    let key = ClusterKey::from_secret(format!("{SECRET}\n").as_bytes(), CLUSTER_ID).unwrap();
    let wrong = ClusterKey::from_secret(b"Zq1Xw2Ce3Rv4Tb5Yn6Um7Ii8Oo9Pp0Aa1Ss2Dd3Ff4G", CLUSTER_ID)
        .unwrap();
    let sock = crafter(net);
    let here = sock.local_addr().unwrap();
    let to = gossip_addr(0);
    let mut codec = Codec::new(&key, CLUSTER_ID, here);
    let mut wrong_codec = Codec::new(&wrong, CLUSTER_ID, here);
    let seal =
        |c: &mut Codec, at: u64| c.seal(b"not a chitchat message", to, at).unwrap().remove(0);
    let r0 = cluster(h0);
    let count = |c: &Value| {
        [
            "rejected_malformed",
            "rejected_stale",
            "rejected_auth",
            "messages_in",
        ]
        .map(|k| counter(c, k))
    };
    let before = count(&r0);
    for junk in [&b"hello"[..], &[0u8; 100][..], b"RLC2\x11short"] {
        sock.send_to(junk, to).unwrap();
    }
    let now = unix_ms();
    for at in [now - 60_000, now - 31_000, now + 60_000] {
        sock.send_to(&seal(&mut codec, at), to).unwrap();
    }
    for _ in 0..2 {
        sock.send_to(&seal(&mut wrong_codec, unix_ms()), to)
            .unwrap();
    }
    // Recorded on its way to h1 (a peer's genuine datagram), replayed to h0.
    let for_h1 = codec
        .seal(b"not a chitchat message", gossip_addr(1), unix_ms())
        .unwrap()
        .remove(0);
    sock.send_to(&for_h1, to).unwrap();
    // Sealed by h1's address, sent from ours (a spoofed source, to reflect a reply).
    let from_h1 = Codec::new(&key, CLUSTER_ID, gossip_addr(1))
        .seal(b"not a chitchat message", to, unix_ms())
        .unwrap()
        .remove(0);
    sock.send_to(&from_h1, to).unwrap();
    let fresh = seal(&mut codec, unix_ms());
    sock.send_to(&fresh, to).unwrap();
    sock.send_to(&fresh, to).unwrap();
    let want = [before[0] + 3, before[1] + 4, before[2] + 4];
    let got = wait_for(
        "h0 to count the crafted datagrams",
        Duration::from_secs(10),
        || {
            let c = count(&cluster(h0));
            (c.iter().zip(&want).all(|(c, w)| c >= w)).then_some(c)
        },
    );
    thread::sleep(Duration::from_millis(300));
    let after = count(&cluster(h0));
    println!(
        "rejected (malformed, stale, auth) before {:?} after {:?}",
        &before[..3],
        &after[..3]
    );
    assert_eq!(after[..3], want[..], "rejections by reason");
    assert_eq!(got[..3], after[..3]);
    let body = scrape(&net.hosts[0].ns);
    for (reason, v) in [
        ("malformed", after[0]),
        ("stale", after[1]),
        ("auth", after[2]),
    ] {
        assert_eq!(
            metric(
                &body,
                &format!("ratelimit_cluster_rejected_total{{reason=\"{reason}\"}}")
            ),
            v
        );
    }
    // Nothing of it reached the cluster's state: h0 still counts h1 alone, nothing charged.
    let c = cluster(h0);
    assert_eq!(peers(&c).len(), 1, "{c}");
    assert_eq!(counter(&c, "charged_pkts"), pkts);
}

/// `send_errors`: h0's gossip link down, its sends fail (no route) and are counted.
fn failed_sends_are_counted(net: &ClusterNet, h0: &AgentProcess, h1: &AgentProcess) {
    let e0 = counter(&cluster(h0), "send_errors");
    assert_eq!(e0, 0, "send errors on a healthy link");
    assert_eq!(counter(&cluster(h1), "send_errors"), 0);
    net.set_gossip(0, false).unwrap();
    let errors = wait_for(
        "send errors with the link down",
        Duration::from_secs(10),
        || {
            let n = counter(&cluster(h0), "send_errors");
            (n > 0).then_some(n)
        },
    );
    net.set_gossip(0, true).unwrap();
    let body = scrape(&net.hosts[0].ns);
    assert!(metric(&body, "ratelimit_cluster_send_errors_total") >= errors);
    // The agent carried on: h1 is counted again once the link is back.
    wait_for("h1 counted again", Duration::from_secs(20), || {
        peer_at(&cluster(h0), gossip_addr(1))
            .iter()
            .any(|p| p["counted"] == true)
            .then_some(())
    });
}
