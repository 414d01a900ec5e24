//! A rule install whose map writes fail after the switch to the new generation (armed with the
//! `fail` crate's fail points in `Dataplane::install`; one test, so that no other install in this
//! binary meets an armed point). Once the switch is made, the new rules are in force: the install
//! must say so (not an error that makes the agent report the old rules while the kernel enforces
//! the new ones, as it did), and the next install must finish what was left undone.

use std::net::Ipv4Addr;

use ratelimit_common::verdict;
use ratelimit_testbed::{
    packet::eth,
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

fn udp(port: u16) -> Vec<u8> {
    eth()
        .ipv4(Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 18, 0, 254))
        .udp(1000, port)
        .build()
}

const ALLOW: &str = "[[rule]]\nname = \"rest\"\nsource = \"198.18.0.0/16\"\naction = \"allow\"\n";

fn deny(name: &str, port: u16) -> String {
    format!(
        "[[rule]]\nname = \"{name}\"\nsource = \"198.18.0.0/16\"\nprotocol = \"udp\"\n\
         dst_port = {port}\naction = \"deny\"\n\n"
    )
}

#[test]
fn an_install_that_fails_after_its_switch_is_in_force_and_the_next_one_finishes_it() {
    require_root();
    let scenario = fail::FailScenario::setup();
    let mut dp = TestDataplane::new("instfault", 1024).expect("load");
    let a = dp
        .install_toml(&format!("{}{ALLOW}", deny("dns", 53)))
        .expect("install a");
    assert_eq!(dp.run(&udp(53)), XDP_DROP);
    assert_eq!(dp.run(&udp(54)), XDP_PASS);

    // The other half of the trie cannot be written after the switch.
    fail::cfg("dataplane-after-switch", "return").expect("arm");
    let b = dp
        .install_toml(&format!("{}{ALLOW}", deny("mdns", 54)))
        .expect("the switch was made: the new rules are in force, and the install says so");
    fail::remove("dataplane-after-switch");
    let mdns = b.by_name("mdns").expect("rule").id;
    let before = dp.rule(mdns).pkts[verdict::DENIED];
    assert_eq!(dp.run(&udp(54)), XDP_DROP, "the new rule is enforced");
    assert_eq!(dp.run(&udp(53)), XDP_PASS, "the removed rule is not");
    assert_eq!(dp.rule(mdns).pkts[verdict::DENIED] - before, 1);

    // The next install switches to the half left unwritten: written whole, it must hold
    // exactly the new set (nothing of the first).
    let c = dp
        .install_toml(&format!("{}{}{ALLOW}", deny("mdns", 54), deny("ntp", 123)))
        .expect("install c");
    assert_eq!(
        dp.run(&udp(53)),
        XDP_PASS,
        "nothing of the first set is left"
    );
    assert_eq!(dp.run(&udp(54)), XDP_DROP);
    assert_eq!(dp.run(&udp(123)), XDP_DROP);
    let d = dp
        .install_toml(&format!("{}{ALLOW}", deny("ntp", 123)))
        .expect("install d");
    assert_eq!(dp.run(&udp(54)), XDP_PASS);
    assert_eq!(dp.run(&udp(123)), XDP_DROP);

    // A removed rule's id that cannot be retired stays live until the next install retires it.
    let ntp = d.by_name("ntp").expect("rule").id;
    fail::cfg("dataplane-retire", "return").expect("arm");
    dp.install_toml(ALLOW)
        .expect("the switch was made: the install says so");
    fail::remove("dataplane-retire");
    assert_eq!(
        dp.run(&udp(123)),
        XDP_PASS,
        "the removed rule is not enforced"
    );
    assert!(
        dp.maps().rule_meta(ntp).expect("meta").is_some(),
        "not retired yet (the fail point)"
    );
    dp.install_toml(&format!("{}{ALLOW}", deny("dns2", 53)))
        .expect("install f");
    assert!(
        dp.maps().rule_meta(ntp).expect("meta").is_none(),
        "the next install retired it"
    );
    assert_eq!(dp.run(&udp(53)), XDP_DROP);
    drop((a, c));
    scenario.teardown();
}
