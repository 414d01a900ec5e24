//! The case's arithmetic on made-up rounds, and its plumbing on a real 3-master Redis Cluster at
//! 3 hosts for 1 s (what it measures is not judged: only that every figure was measured and the
//! budget divided).

use super::*;

#[test]
fn a_rounds_figure_holds_until_the_next_or_until_its_shares_lapse() {
    // Whole rate 100 pps; rounds at 1.0 s (10 pps) and 1.1 s (20 pps); lag 0.3 s.
    let rounds = [(0.5, 50.0), (1.0, 10.0), (1.1, 20.0)];
    // [1.0, 1.1]: 10 pps; [1.1, 1.4]: 20 pps; [1.4, 2.0]: lapsed, 100 pps.
    let got = admitted_over(&rounds, 1.0, 2.0, 0.3, 100.0);
    assert!((got - (1.0 + 6.0 + 60.0)).abs() < 1e-9, "{got}");
    // From 0.9: the round at 0.5 holds until 0.8, so [0.9, 1.0] is at the whole rate.
    let got = admitted_over(&rounds, 0.9, 1.1, 0.3, 100.0);
    assert!((got - (10.0 + 1.0)).abs() < 1e-9, "{got}");
    // No round at all: the whole rate (a new key's bucket, fail open).
    assert!((admitted_over(&[], 0.0, 2.0, 0.3, 100.0) - 200.0).abs() < 1e-9);
}

#[test]
fn the_heavy_keys_demand_is_split_95_5_and_adds_up_to_the_flood() {
    for n in [1, 3, 10, 100, 2000] {
        let total: f64 = (0..n).map(|i| heavy_demand(i, n)).sum();
        assert!((total - FLOOD * RATE).abs() < 1e-6, "{n}: {total}");
    }
    let hot = heavy_demand(0, 100) * 5.0;
    assert!((hot - 0.95 * FLOOD * RATE).abs() < 1e-6);
    // A host at its share of the budget admits that share, the program's rounding up of the
    // cost taking a hair off; at share 1 (word 0) the whole rate.
    assert!((admitted_at(0.25, 4000.0) - 250.0).abs() < 0.01);
    assert!((admitted_at(1.0, 4000.0) - RATE).abs() < 1e-9);
    assert!((admitted_at(0.5, 10.0) - 10.0).abs() < 1e-9);
}

/// Catches the case's plumbing breaking (the cluster not formed, the store's client not
/// reaching it, no counters read, the shares not computed from what the store returned): 3
/// hosts for 1 s must run rounds, see each other on every heavy key, make Redis run their
/// scripts and divide the budget (at 3 hosts every host hears the others within a round, so
/// admitted / budget is about 1; 1.5 or more means the shares were not applied).
#[test]
fn three_hosts_against_a_real_cluster_measure_every_figure() {
    let cluster = LocalRedisCluster::start(MASTERS, "unit").unwrap();
    let dir = cluster.dir().to_path_buf();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = measure(&rt, &cluster, 3, 1.0, 1.0).unwrap();
    drop(rt);
    drop(cluster);
    assert!(!dir.exists(), "the cluster's directory is removed");
    assert_eq!(s.hosts, 3);
    assert_eq!(s.holders_seen_max, 3, "{s:?}");
    assert!(s.rounds_per_host > 0.0 && s.rtt_p50_ms.is_finite(), "{s:?}");
    assert!(s.cmds_per_host > 0.0, "{s:?}");
    assert!(
        s.bytes_in_per_host > 0.0 && s.bytes_out_per_host > 0.0,
        "{s:?}"
    );
    assert!(s.redis_cpu >= 0.0 && s.client_cpu >= 0.0, "{s:?}");
    assert!(s.admitted_ok.is_finite(), "{s:?}");
    assert!(
        (0.8..1.5).contains(&s.admitted),
        "admitted / budget {} at 3 hosts: {s:?}",
        s.admitted
    );
}

/// More holders of one key than a script returns one by one (64) still divide its budget
/// whole: 70 hosts, each with a real `RedisStore` against a real cluster, write their demand
/// for one key (1,400 packets/s in all for a budget of 1,000), then read it back. Each host
/// must count all 70 holders and the whole demand, so that the shares they set add up to one
/// budget. With the other holders capped at 64 fields, each host saw 65 of the 70 and the
/// shares added up to about 1.07 budgets.
#[test]
fn more_holders_than_fields_returned_still_divide_the_budget_whole() {
    const N: usize = 70;
    let cluster = LocalRedisCluster::start(MASTERS, "holders").unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let config = RedisConfig {
        urls: cluster.urls(),
        user: None,
        password_file: None,
        ca_file: None,
        connect_timeout_ms: DEFAULT_REDIS_CONNECT_TIMEOUT_MS,
        command_timeout_ms: 5_000,
    };
    let key = key_name("holders", RULE, 0, heavy_addr(0));
    #[expect(clippy::cast_precision_loss, reason = "a small index")]
    let demand = |i: usize| 10.0 + 0.4 * i as f64;
    let mut stores: Vec<RedisStore> = (0..N)
        .map(|i| {
            RedisStore::new(&config, "holders", format!("h-{i}/198.18.1.{}", i + 1), 1).unwrap()
        })
        .collect();
    let mut read = vec![Vec::new(); N];
    for pass in 0..2 {
        for (i, store) in stores.iter_mut().enumerate() {
            let entries = [Entry {
                key: key.clone(),
                demand: demand(i),
            }];
            let x = rt
                .block_on(store.exchange(&entries, 60_000, 120_000))
                .unwrap();
            assert_eq!(x.refused, 0, "host {i}: nothing refused");
            if pass == 1 {
                read[i] = x.fields.into_iter().next().unwrap();
            }
        }
    }
    let total: f64 = (0..N).map(demand).sum();
    let mut shares_sum = 0.0;
    for (i, fields) in read.iter().enumerate() {
        let holders = 1 + fields.iter().map(|f| f.holders).sum::<u32>();
        let peers: f64 = fields.iter().map(|f| f.demand).sum();
        assert_eq!(holders as usize, N, "host {i}: holders counted");
        assert!(
            (demand(i) + peers - total).abs() < 0.01,
            "host {i}: demand {} + {peers} of {total}",
            demand(i)
        );
        let s = shares::share(demand(i), peers, 1.0, Some(RATE), f64::from(holders));
        shares_sum += s;
    }
    assert!(
        (shares_sum - 1.0).abs() < 1e-3,
        "the shares of {N} holders add up to {shares_sum} budgets"
    );
}
