//! `[cluster] backend = "redis"` over TLS: a real `redis-server` serving `rediss://` with a
//! certificate of a private CA (made by `openssl` for the test), three real agents.
//!
//! - h0 and h1 name the CA in `redis_ca_file`: they reach the store over TLS and share one
//!   budget (0.95-1.05 of it over 5 s, the source split 50/50 over them at 4x the budget).
//! - h2 names no CA, so it checks the store's certificate against the system's roots, which do
//!   not hold the test's CA: it shows the store `down` with the certificate error, and fails
//!   open (a source under its rate there passes whole).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use ratelimit_testbed::{
    cluster_net::{counted_peers, status, ClusterNet, Samples, Split, REDIS_ADDR},
    redis::RedisServer,
    require_root,
};

use crate::{serial, store, within, Bed, ACCURACY, BURST, RATE, SYNC_MS};

const TAG: &str = "rl-credtls";
const END: f64 = 9.0;

#[test]
fn agents_share_one_budget_over_tls_with_a_private_ca_and_refuse_a_store_they_cannot_verify() {
    require_root();
    let _serial = serial();
    let bed = start();
    wait_until_h0_h1_connected_and_h2_refused(&bed);
    assert_h2_names_the_certificate(&bed);
    let (shared, alone) = flood_4_budgets_at_h0_h1_and_500_pps_at_h2(&bed);
    assert!(
        within(shared, ACCURACY),
        "h0 and h1 over TLS admitted {shared:.3} budgets, want {ACCURACY:?}"
    );
    assert!(
        alone >= 450.0,
        "h2, unable to verify the store, must fail open: {alone:.0} pps of 500"
    );

    bed.teardown(TAG);
}

/// The network, a Redis server serving TLS with a certificate of a throwaway CA (the CA's files
/// removed with the server), and an agent on each host: h0 and h1 naming the CA, h2 not; none
/// waited for (h2 never connects). Then the receivers.
fn start() -> Bed<(RedisServer, Certs)> {
    let net = ClusterNet::new(TAG, 3).unwrap();
    let certs = Certs::new(REDIS_ADDR.ip());
    let tls_port = (REDIS_ADDR.port() + 1).to_string();
    let redis = net
        .start_redis_with(&[
            "--tls-port",
            &tls_port,
            "--tls-cert-file",
            &arg(&certs.path("server.crt")),
            "--tls-key-file",
            &arg(&certs.path("server.key")),
            "--tls-ca-cert-file",
            &arg(&certs.path("ca.crt")),
            "--tls-auth-clients",
            "no",
        ])
        .unwrap();
    let url = format!("rediss://{}:{tls_port}", REDIS_ADDR.ip());
    let ca = arg(&certs.path("ca.crt"));
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "small"
    )]
    let agents = net
        .start_agents_unwaited(|i| {
            let c = net.redis_config(i, RATE as u64, BURST, SYNC_MS, &url);
            if i < 2 {
                c.replace(
                    "redis_connect_timeout_ms",
                    &format!("redis_ca_file = \"{ca}\"\nredis_connect_timeout_ms"),
                )
            } else {
                c
            }
        })
        .unwrap();
    let receivers = net.receivers().unwrap();
    Bed {
        receivers,
        agents,
        redis: (redis, certs),
        net,
        url,
    }
}

/// Waits (10 s at most) until h0 and h1 are connected over TLS, each counting the other, and h2
/// shows the store down.
fn wait_until_h0_h1_connected_and_h2_refused(bed: &Bed<(RedisServer, Certs)>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st: Vec<_> = bed.agents.iter().map(|a| status(a).unwrap()).collect();
        let ok = st[..2]
            .iter()
            .all(|s| store(s)["state"] == "connected" && counted_peers(s).len() == 1);
        if ok && store(&st[2])["state"] == "down" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stores: {}, {}, {}",
            store(&st[0]),
            store(&st[1]),
            store(&st[2])
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// h2's store error names the certificate it could not verify.
fn assert_h2_names_the_certificate(bed: &Bed<(RedisServer, Certs)>) {
    let h2 = status(&bed.agents[2]).unwrap();
    let why = store(&h2)["last_error"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    println!("h2 (no CA): {}", store(&h2));
    assert!(
        why.contains("certificate") || why.contains("unknownissuer") || why.contains("tls"),
        "h2's error names the certificate: {why:?}"
    );
}

/// 4 budgets at h0 and h1, half each, and 500 pps at h2 (under its whole rate), for [`END`] s:
/// what h0 and h1 admitted together from 3 to 8 s, in budgets, and h2 alone, in pps.
fn flood_4_budgets_at_h0_h1_and_500_pps_at_h2(bed: &Bed<(RedisServer, Certs)>) -> (f64, f64) {
    let start = Instant::now();
    let sender = bed
        .net
        .flood(
            vec![Split {
                end: END,
                pps: 4.0 * RATE + 500.0,
                weights: vec![2000.0, 2000.0, 500.0],
            }],
            start,
        )
        .unwrap();
    let mut samples = Samples::default();
    samples.take_until(&bed.receivers, start, END, Duration::from_millis(100));
    sender.join().unwrap();
    let (t1, t2) = (3.0, 8.0);
    let shared = (samples.host_rate(0, t1, t2) + samples.host_rate(1, t1, t2)) / RATE;
    let alone = samples.host_rate(2, t1, t2);
    println!(
        "h0 + h1 over TLS: {shared:.3} budgets ({:.0} + {:.0} pps); h2 without the store: {alone:.0} pps of 500",
        samples.host_rate(0, t1, t2),
        samples.host_rate(1, t1, t2)
    );
    (shared, alone)
}

/// A throwaway CA and a server certificate for `ip`, made with `openssl`; removed on drop.
struct Certs(PathBuf);

impl Certs {
    fn new(ip: std::net::IpAddr) -> Self {
        let dir = std::env::temp_dir().join(format!("rl-redis-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let certs = Self(dir);
        let ext = certs.path("ext.cnf");
        std::fs::write(&ext, format!("subjectAltName=IP:{ip}\n")).unwrap();
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&certs.0)
                .output()
                .expect("openssl (apt-get install openssl)");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=rl-test-ca",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=rl-test-redis",
        ]);
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ]);
        certs
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn arg(p: &Path) -> String {
    p.display().to_string()
}
