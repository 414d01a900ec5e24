//! The compiler's unit tests: the helpers they share here, the tests by subject in the modules
//! below.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;

mod ids;
mod ipv4_table;
mod prefixes;
mod records;
mod reference;
mod syn;

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const ICMPV6: u8 = 58;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn limit(name: &str, source: &str, rate: u64) -> RuleConfig {
    RuleConfig {
        rate: Some(rate),
        burst: Some(rate),
        ..RuleConfig::new(name, net(source))
    }
}

fn with_action(name: &str, source: &str, action: Action) -> RuleConfig {
    RuleConfig {
        action,
        ..RuleConfig::new(name, net(source))
    }
}

fn proto(mut r: RuleConfig, protocol: Protocol, port: Option<u16>) -> RuleConfig {
    r.protocol = protocol;
    r.dst_port = port;
    r
}

fn build(rules: &[RuleConfig]) -> CompiledRuleSet {
    compile(rules, &RuleIds::new()).unwrap_or_else(|e| panic!("compile failed: {e}"))
}

fn name_of<'a>(
    set: &'a CompiledRuleSet,
    src: &str,
    protocol: u8,
    port: Option<u16>,
) -> Option<&'a str> {
    set.classify(ip(src), protocol, port, 0)
        .map(|r| r.name.as_str())
}

fn candidate_names(set: &CompiledRuleSet, prefix: &str) -> Vec<String> {
    let p = set
        .prefixes
        .iter()
        .find(|p| p.net() == net(prefix))
        .expect("prefix compiled");
    p.candidates()
        .iter()
        .map(|&id| set.rule(id).unwrap().name.clone())
        .collect()
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| net(s)).collect()
}

fn multi(name: &str, sources: &[&str], action: Action) -> RuleConfig {
    let mut r = RuleConfig {
        action,
        ..RuleConfig::with_sources(name, nets(sources))
    };
    if action == Action::Limit {
        r.rate = Some(10);
        r.burst = Some(10);
    }
    r
}
