//! A 100,000-entry deny list loaded from a file by the real agent: it loads (the time is
//! printed), it drops the listed source's real packets and passes an unlisted one, and replacing
//! the file swaps the list in: afterwards the two sources have traded places. (That no packet
//! ever sees half a rule set is the generation flip's job, covered in tests/buckets.rs,
//! `a_rule_set_swap_is_seen_whole_by_every_packet`.)

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use ratelimit_testbed::agent_proc::rule_packets;
use ratelimit_testbed::{
    add_addr, neigh_to_peer, require_root, send_udp_from, veth_pair, AgentProcess, Netns, Receiver,
};

const RECEIVER: &str = "198.18.0.254";
const LISTED_FIRST: &str = "198.18.0.1";
const LISTED_SECOND: &str = "198.18.0.2";

/// 100,000 /32s in 198.19.0.0/16 and beyond (none of them the test's addresses) plus `extra`.
fn write_list(path: &Path, extra: &str) {
    let mut list = String::from("# generated deny list\n");
    for i in 0..100_000u32 {
        let a = 0xC613_0000u32 + i * 2; // 198.19.0.0 upwards
        let _ = writeln!(
            list,
            "{}.{}.{}.{}/32",
            a >> 24,
            (a >> 16) & 255,
            (a >> 8) & 255,
            a & 255
        );
    }
    let _ = writeln!(list, "{extra}/32   # the test source");
    // Write + rename, as a config manager would: the agent never sees half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, list).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn delivered(tx: &Netns, rx: &Netns, src: &str) -> (u64, u64) {
    let receiver = Receiver::bind(rx, SocketAddr::new(RECEIVER.parse().unwrap(), 0)).unwrap();
    let sent = send_udp_from(
        tx,
        SocketAddr::new(src.parse().unwrap(), 0),
        receiver.local_addr(),
        2000,
        Duration::from_millis(250),
        64,
    )
    .unwrap();
    receiver.wait_idle(Duration::from_millis(100), Duration::from_secs(2));
    let got = receiver
        .stop()
        .unwrap()
        .counts()
        .get(&src.parse().unwrap())
        .copied()
        .unwrap_or(0);
    (sent.sent, got)
}

#[test]
fn hundred_thousand_entry_deny_list_loads_enforces_and_swaps_whole() {
    require_root();
    let tx = Netns::new("rl-e2e-list-tx").unwrap();
    let rx = Netns::new("rl-e2e-list-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "el").unwrap();
    add_addr(&tx, &tx_if, &format!("{LISTED_FIRST}/24")).unwrap();
    add_addr(&tx, &tx_if, &format!("{LISTED_SECOND}/24")).unwrap();
    add_addr(&rx, &rx_if, &format!("{RECEIVER}/24")).unwrap();
    neigh_to_peer(&tx, &tx_if, RECEIVER.parse().unwrap(), &rx, &rx_if).unwrap();

    let dir = std::env::temp_dir().join(format!("rl-e2e-list-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let list = dir.join("deny.txt");
    write_list(&list, LISTED_FIRST);
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\n\n[[rule]]\nname = \"blocklist\"\nsource_file = \"{}\"\naction = \"deny\"\n",
        list.display()
    );
    let started = Instant::now();
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    println!("agent with a 100,001-entry list attached after {:?} (process start, verifier, parse, compile, install)", started.elapsed());

    let (sent, got) = delivered(&tx, &rx, LISTED_FIRST);
    assert!(
        sent > 0 && got == 0,
        "listed source: {got} of {sent} arrived"
    );
    let (sent, got) = delivered(&tx, &rx, LISTED_SECOND);
    assert_eq!(got, sent, "unlisted source must pass");

    // Swap the list: the first source leaves it, the second joins. The agent's watcher reloads.
    let denied_before = rule_packets(&agent.stats(), "blocklist", "denied");
    write_list(&list, LISTED_SECOND);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (sent1, got1) = delivered(&tx, &rx, LISTED_FIRST);
        let (_, got2) = delivered(&tx, &rx, LISTED_SECOND);
        if got1 == sent1 && got2 == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new list never took effect:\n{}",
            agent.log()
        );
    }
    assert!(rule_packets(&agent.stats(), "blocklist", "denied") > denied_before);
    agent.stop().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
