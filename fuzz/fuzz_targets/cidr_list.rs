//! `source_file` lists (`config::parse_list`): any bytes give prefixes or the line of the first
//! bad entry, never a panic; the prefixes are distinct, canonical (no host bits), in file order,
//! print and parse back to themselves, and make a rule that compiles.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ratelimit::{
    compile::{compile, RuleIds},
    config::{parse_list, Action, RuleConfig},
};

fuzz_target!(|data: &[u8]| {
    let (nets, lines) = match parse_list(data) {
        Ok(parsed) => parsed,
        Err((line, message)) => {
            let count = data.split(|&b| b == b'\n').count();
            assert!(
                (1..=count).contains(&line),
                "error line {line} of {count}: {message}"
            );
            return;
        }
    };
    assert_eq!(nets.len(), lines.len());
    assert!(
        lines.windows(2).all(|w| w[0] < w[1]),
        "lines out of order: {lines:?}"
    );
    let mut seen = std::collections::HashSet::new();
    for net in &nets {
        assert_eq!(net.trunc(), *net, "{net} has host bits");
        assert!(seen.insert(*net), "{net} listed twice");
    }
    let printed: String = nets.iter().map(|n| format!("{n}\n")).collect();
    let (again, _) = parse_list(printed.as_bytes()).expect("printed prefixes parse");
    assert_eq!(again, nets);
    if !nets.is_empty() {
        let mut rule = RuleConfig::with_sources("list", nets);
        rule.action = Action::Deny;
        if let Err(e) = compile(&[rule], &RuleIds::new()) {
            panic!("a list that parsed does not compile: {e}");
        }
    }
});
