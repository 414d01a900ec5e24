//! Config files (`Config::parse`): any text gives a config or an error naming where, never a
//! panic; and a config that parses is written back by `render_rules` (what `rules add/remove`
//! do to the file) as text that parses to the same config. `source_file` lists are read from a
//! directory of the target's own (good, empty and bad lists), so rules with lists are fuzzed too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ratelimit::{
    compile::{compile, RuleIds},
    config::{render_rules, Config},
};

/// The list files `source_file` may name, written once into a directory of this process's own;
/// the config "lives" there, so relative names resolve to them (or to nothing).
const LISTS: [(&str, &str); 4] = [
    ("a.list", "# office\n198.18.0.0/24\n\n198.18.1.7\n"),
    (
        "b.list",
        "2001:db8::/32\n198.19.0.0/16 # trailing comment\n",
    ),
    ("empty.list", ""),
    ("bad.list", "198.18.0.0/24\nnot a cidr\n"),
];

/// The config's path, in the list directory (created on first use).
fn origin() -> &'static str {
    static ORIGIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ORIGIN.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("ratelimit-fuzz-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("list directory");
        for (name, text) in LISTS {
            std::fs::write(dir.join(name), text).expect("list file");
        }
        dir.join("ratelimit.toml").display().to_string()
    })
}

/// Whether every `source_file` in `text` (any table, any spelling of the key) is a plain name
/// in the list directory: no path separator, not `.` or `..`. Anything else (an absolute path,
/// `/dev/zero`, a path out of the directory) would have the parser read files the fuzzer should
/// not touch, so such inputs are skipped.
fn lists_stay_home(text: &str) -> bool {
    fn walk(v: &toml::Value) -> bool {
        match v {
            toml::Value::Table(t) => t.iter().all(|(k, v)| {
                if k == "source_file" {
                    matches!(v, toml::Value::String(s)
                        if !s.contains(['/', '\\', '\0']) && s != "." && s != "..")
                } else {
                    walk(v)
                }
            }),
            toml::Value::Array(a) => a.iter().all(walk),
            _ => true,
        }
    }
    // What this TOML parser cannot read is skipped too (the config parser might differ).
    toml::from_str::<toml::Table>(text).is_ok_and(|t| walk(&toml::Value::Table(t)))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if !lists_stay_home(text) {
        return;
    }
    let origin = origin();
    let Ok(config) = Config::parse(text, origin) else {
        return;
    };
    // Valid rules either compile or are refused with an error (too many candidates per prefix).
    let _ = compile(&config.rules, &RuleIds::new());
    let rendered = render_rules(text, origin, &config.rules).expect("a file that parsed renders");
    let again = Config::parse(&rendered, origin).unwrap_or_else(|e| {
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
