//! Rule bodies of `POST /v1/rules` (`api::rule_from_json`): any JSON gives a rule or an error
//! naming the field, never a panic; an accepted rule compiles, and the JSON the API answers with
//! (`rules list`) is accepted back as the same rule.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ratelimit::{
    api::rule_from_json,
    compile::{compile, RuleIds},
};

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(rule) = rule_from_json(&value) else {
        return;
    };
    if let Err(e) = compile(std::slice::from_ref(&rule), &RuleIds::new()) {
        panic!("accepted rule does not compile: {e}\n{value}");
    }
    let shown = serde_json::to_value(&rule).expect("a rule serializes");
    let again = rule_from_json(&shown)
        .unwrap_or_else(|e| panic!("the API's own answer {shown} is refused: {e}"));
    assert_eq!(again, rule, "round trip through {shown}");
});
