//! A rule sent as JSON, read through the config file's own parser ([`rule_from_json`]). Its own
//! room because it is the bridge from JSON to TOML that keeps both ways in alike.

use serde_json::Value;

use crate::config::RuleConfig;

/// Builds a rule from its JSON object (the config file's keys and spellings) and validates it,
/// through the config file's own parser ([`crate::config::Config::parse_rule`]): the object is
/// written as one `[[rule]]` table, so a rule gets the same defaults, ranges and messages by
/// either way in. `null` stands for a key not given. The error names the rule and the key at
/// fault, as the file's message does after its file and line.
pub fn rule_from_json(v: &Value) -> Result<RuleConfig, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("a rule must be a JSON object, got {v}"))?;
    let mut rules = toml::Table::new();
    rules.insert(
        "rule".to_owned(),
        toml::Value::Array(vec![toml::Value::Table(toml_table(obj)?)]),
    );
    let text = toml::to_string(&rules).map_err(|e| format!("the rule cannot be read: {e}"))?;
    let mut rule =
        crate::config::Config::parse_rule(&text, "request").map_err(|e| e.without_place())?;
    // A rule from the API has no line until the config file it is written to gives it one.
    rule.line = 0;
    Ok(rule)
}

/// A JSON object as a TOML table: `null` values left out (a key not given), numbers as TOML
/// integers where they are whole (the config's checks give the ranges), other values as they
/// are. TOML has no integer above `i64::MAX`: such a number is refused here, naming its key.
fn toml_table(obj: &serde_json::Map<String, Value>) -> Result<toml::Table, String> {
    let mut t = toml::Table::new();
    for (key, value) in obj {
        if let Some(v) = toml_value(value, key)? {
            t.insert(key.clone(), v);
        }
    }
    Ok(t)
}

fn toml_value(v: &Value, key: &str) -> Result<Option<toml::Value>, String> {
    Ok(Some(match v {
        Value::Null => return Ok(None),
        Value::Bool(b) => toml::Value::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => toml::Value::Integer(i),
            (None, _) if n.is_u64() => {
                return Err(format!("field `{key}`: {n} is out of range"));
            }
            (None, Some(f)) => toml::Value::Float(f),
            (None, None) => return Err(format!("field `{key}`: {n} is not a number")),
        },
        Value::String(s) => toml::Value::String(s.clone()),
        Value::Array(items) => toml::Value::Array(
            items
                .iter()
                .map(|item| {
                    toml_value(item, key)?
                        .ok_or_else(|| format!("field `{key}`: null inside an array"))
                })
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(o) => toml::Value::Table(toml_table(o)?),
    }))
}
