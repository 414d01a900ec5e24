//! `[cluster] backend = "redis"`, end to end: three real agents ([`ClusterNet`]) share one
//! `scope = "cluster"` budget by exchanging their demand through a real `redis-server` (run in
//! the switch namespace, on the gossip bridge: [`ClusterNet::start_redis`]), with no gossip at
//! all. One source floods at 5x the budget, split 70/20/10 over the hosts. One scenario a file:
//! - `restarted.rs`: Redis up, killed, started again empty, restarted empty mid-run;
//! - `acl.rs`: a Redis Cluster as an ACL user, h0's password wrong and then right, then changed;
//! - `cut_off.rs`: one host cut off from the store, then healed;
//! - `paused.rs`: Redis paused, and the agents back by themselves;
//! - `failover.rs`: through a Redis Cluster of 3 masters and 3 replicas, one shard failing over;
//! - `tls.rs`: over TLS with a private CA, and a host that cannot verify the store.
//!
//! Run with `--nocapture` for the figures.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ratelimit_testbed::cluster::stop_agents;
use ratelimit_testbed::{
    assert_none_left,
    cluster_net::{counted_peers, status, ClusterNet, Sent, Split},
    redis::RedisServer,
    AgentProcess, Receiver,
};
use serde_json::Value;

mod acl;
mod cut_off;
mod failover;
mod paused;
mod restarted;
mod tls;

const HOSTS: usize = 3;
const RATE: f64 = 1000.0;
const BURST: u64 = 500;
const SYNC_MS: u64 = 100;
const FLOOD_PPS: f64 = 5000.0;
const SPLIT: [f64; 3] = [70.0, 20.0, 10.0];
/// docs/cluster.md's accuracy of one budget (see `e2e_cluster`).
const ACCURACY: (f64, f64) = (0.95, 1.05);

/// Whether `r` (admitted over a window, in budgets) is within `range`, ends included.
fn within(r: f64, range: (f64, f64)) -> bool {
    r >= range.0 && r <= range.1
}
const SAMPLE: Duration = Duration::from_millis(100);
/// docs/cluster.md's lag: 4 sync intervals.
const LAG_SECS: f64 = 0.4;
/// How far the sampling can misplace an admission in time, at either end of a window.
const SKEW_SECS: f64 = 0.1;

/// One scenario at a time: two runs of agents, a Redis server and a 4,000-5,000 pps flood on 2
/// cores would disturb each other's rates (as `e2e_cluster_partition`'s runs).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a scenario runs, for its phases to share: the store is a [`RedisServer`] but where a
/// scenario says otherwise (a Redis Cluster, a server with the files it needs). The fields drop
/// in this order, on a panic too: the receivers, the agents, the store, then the network they
/// all run in; a scenario holds its [`serial`] guard from before its `Bed` is made until after
/// it is dropped, and ends it with [`Bed::teardown`].
struct Bed<S = RedisServer> {
    receivers: Vec<Receiver>,
    agents: Vec<AgentProcess>,
    redis: S,
    net: ClusterNet,
    /// The store's address, as the agents are given it (a cluster's nodes, comma-separated).
    url: String,
}

impl Bed {
    /// The network of `tag` with [`HOSTS`] hosts, one Redis server, and an agent on each host
    /// sharing the budget through it (`agent_keys` added to its `[agent]` table), each started
    /// until it counts the others, then the receivers. `check` sees the agents before the
    /// receivers start.
    fn start(tag: &str, agent_keys: &str, check: impl Fn(&[AgentProcess])) -> Bed {
        let net = ClusterNet::new(tag, HOSTS).unwrap();
        let redis = net.start_redis().unwrap();
        let url = redis.url();
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "small"
        )]
        let agents = net
            .start_agents_with(
                |i| {
                    net.redis_config(i, RATE as u64, BURST, SYNC_MS, &url)
                        .replacen("[agent]\n", &format!("[agent]\n{agent_keys}"), 1)
                },
                Duration::from_secs(30),
            )
            .unwrap();
        check(&agents);
        let receivers = net.receivers().unwrap();
        Bed {
            receivers,
            agents,
            redis,
            net,
            url,
        }
    }
}

/// The flood of [`FLOOD_PPS`], split [`SPLIT`] over the hosts, from `start` until `end` s
/// after it.
fn flood(net: &ClusterNet, end: f64, start: Instant) -> JoinHandle<Sent> {
    net.flood(
        vec![Split {
            end,
            pps: FLOOD_PPS,
            weights: SPLIT.to_vec(),
        }],
        start,
    )
    .unwrap()
}

fn store(st: &Value) -> &Value {
    &st["cluster"]["store"]
}

/// Whether every agent of `agents` is connected to the store and counts all the others.
fn all_connected(agents: &[AgentProcess]) -> bool {
    agents.iter().all(|a| {
        status(a).is_ok_and(|st| {
            store(&st)["state"] == "connected" && counted_peers(&st).len() == agents.len() - 1
        })
    })
}

/// `ratelimit --socket S peers`, as an operator reads it.
fn peers_text(agent: &AgentProcess) -> String {
    let out = std::process::Command::new(ratelimit_testbed::agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .arg("peers")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl<S> Bed<S> {
    /// Stops the receivers, the agents (each must exit cleanly), the store and the network of
    /// `tag`, and asserts that none of this process's namespaces of `tag` is left behind.
    fn teardown(self, tag: &str) {
        let Bed {
            receivers,
            agents,
            redis,
            net,
            ..
        } = self;
        drop(receivers);
        stop_agents(agents);
        drop(redis);
        drop(net);
        assert_none_left(&format!("{tag}-"));
    }
}
