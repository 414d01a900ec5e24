//! Config files (`Config::parse`): any text gives a config or an error naming where, never a
//! panic; and a config that parses is written back by `render_rules` (what `rules add/remove`
//! do to the file) as text that parses to the same config.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ratelimit::{
    compile::{compile, RuleIds},
    config::{render_rules, Config},
};

/// A directory that does not exist, so relative `source_file` paths resolve to nothing.
const ORIGIN: &str = "/nonexistent-ratelimit-fuzz/ratelimit.toml";

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // `source_file` makes the parser read files (think /dev/zero): keep the fuzzer off the file
    // system. A quoted key can spell it with \u escapes, hence those too. Lists have their own
    // target (cidr_list).
    if text.contains("source_file") || text.contains("\\u") || text.contains("\\U") {
        return;
    }
    let Ok(config) = Config::parse(text, ORIGIN) else {
        return;
    };
    // Valid rules either compile or are refused with an error (too many candidates per prefix).
    let _ = compile(&config.rules, &RuleIds::new());
    let rendered = render_rules(text, ORIGIN, &config.rules).expect("a file that parsed renders");
    let again = Config::parse(&rendered, ORIGIN).unwrap_or_else(|e| {
        panic!("the rendered file does not parse: {e}\n--- input\n{text}\n--- rendered\n{rendered}")
    });
    let lineless = |c: &Config| {
        let mut rules = c.rules.clone();
        for r in &mut rules {
            r.line = 0;
        }
        rules
    };
    assert_eq!(
        lineless(&again),
        lineless(&config),
        "rules changed by rendering:\n{rendered}"
    );
    assert_eq!(
        again.agent, config.agent,
        "[agent] changed by rendering:\n{rendered}"
    );
    assert_eq!(
        again.cluster, config.cluster,
        "[cluster] changed by rendering:\n{rendered}"
    );
});
