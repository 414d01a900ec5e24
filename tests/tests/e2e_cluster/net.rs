//! The test network, the testbed's [`ClusterNet`] (a switch namespace with two bridges, the sender
//! with the flood and the polite source, four hosts, the cluster's key and h3's wrong one); the
//! agents in it and the receivers of the flood; and taking them down at the end.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use ratelimit_testbed::cluster_net::{data_ip, gossip_ip, ClusterHost, ClusterNet};
use ratelimit_testbed::{assert_none_left, AgentProcess, Receiver};

use crate::{Cluster, BURST, FLOOD, GOSSIP_PORT, POLITE, PORT, RATE, SYNC_MS};

/// h3's key: not the cluster's.
const WRONG_SECRET: &str = "Zq1Xw2Ce3Rv4Tb5Yn6Um7Ii8Oo9Pp0Aa1Ss2Dd3Ff4G";

impl Cluster {
    /// The network, then the agents (h0..h2 with the cluster key, h3 with another, all seeded
    /// with h0..h2), then a receiver of the flood on each host.
    pub(crate) fn start() -> Cluster {
        let net = ClusterNet::new("rl-cl", 4).unwrap();
        net.add_source(FLOOD).unwrap();
        net.add_source(POLITE).unwrap();
        let wrong = net.write_key("wrong.key", WRONG_SECRET).unwrap();
        let mut agents = Vec::new();
        for (i, host) in net.hosts.iter().enumerate() {
            let key = if i < 3 { &net.key_file } else { &wrong };
            let agent = AgentProcess::start(&host.ns, &config(host, i, key, 3), &[])
                .unwrap_or_else(|e| panic!("agent h{i}: {e:#}"));
            agents.push(agent);
        }
        let receivers: Vec<Receiver> = (0..4)
            .map(|i| {
                Receiver::bind(
                    &net.hosts[i].ns,
                    SocketAddr::new(IpAddr::V4(data_ip(i)), PORT),
                )
                .unwrap()
            })
            .collect();
        Cluster {
            receivers,
            agents,
            down: [false; 4],
            net,
        }
    }

    /// Clean up: agents detach and unpin; namespaces go; none of this run's is left behind.
    pub(crate) fn clean_up(self) {
        // The receivers were stopped by `the_polite_source_loses_nothing`.
        let Cluster {
            agents, down, net, ..
        } = self;
        for (i, agent) in agents.into_iter().enumerate() {
            if down[i] {
                // Killed: its pins (and so the attached program) are removed by the drop.
                drop(agent);
            } else {
                agent
                    .stop()
                    .unwrap_or_else(|e| panic!("stopping h{i}: {e:#}"));
            }
        }
        // The hosts, the sender, the switch, the key directory: `ClusterNet`'s fields in order.
        drop(net);
        assert_none_left("rl-cl-");
    }
}

fn config(host: &ClusterHost, i: usize, key: &Path, cluster_hosts: usize) -> String {
    let seeds: Vec<String> = (0..cluster_hosts)
        .map(|j| format!("{}:{GOSSIP_PORT}", gossip_ip(j)))
        .collect();
    format!(
        r#"[agent]
interfaces = ["{}"]
mode = "auto"

[[rule]]
name = "cluster-flood"
source = "198.18.0.0/24"
rate = {RATE}
burst = {BURST}
per = "source"
scope = "cluster"

[cluster]
listen = "{}:{GOSSIP_PORT}"
seeds = {seeds:?}
key_file = "{}"
sync_interval_ms = {SYNC_MS}
cluster_id = "e2e-cluster"
"#,
        host.data_if,
        gossip_ip(i),
        key.display()
    )
}
