//! The TOML config file (`/etc/ratelimit/ratelimit.toml`): parsing and validation.
//!
//! Every error names the file, the 1-based line and the key it is about, e.g.
//! `/etc/ratelimit/ratelimit.toml:14: rule "dns": field `dst_port`: only valid with protocol tcp or udp`.
//!
//! Parsing is two-staged. The text is first deserialized into private `Raw*` mirrors whose fields
//! are [`toml::Spanned`], so that type errors come from the TOML deserializer with a span and
//! semantic errors found afterwards can still point at the offending value. The raw form is then
//! converted into the public typed form ([`Config`]), filling in defaults; cross-field rule checks
//! live in [`RuleConfig::validate`] so that rules that do not come from a file (added over the
//! control socket) go through exactly the same checks.
//!
//! The document is parsed with `toml_edit` rather than `toml::from_str` because its parsed tree
//! keeps the position of every key: when the deserializer reports an error at some byte offset we
//! walk that tree to find which key (and which `[[rule]]`) the offset belongs to, since the error
//! itself only carries the span and a message.
//!
//! A rule's sources are one CIDR (`source = "10.0.0.0/8"`), an array of them, or a list file
//! (`source_file = "deny.txt"`, relative to the config file's directory): one CIDR per line, `#`
//! comments, blank lines ignored. Errors in a list name the list file and its line, then the rule
//! and the config line naming the list:
//! `/etc/ratelimit/deny.txt:1234: invalid CIDR "10.0.0.300/8" (rule "blocklist", /etc/ratelimit/ratelimit.toml:20)`.
//! A rule lists at most [`MAX_RULE_PREFIXES`], all rules together at most [`MAX_TOTAL_PREFIXES`]
//! distinct prefixes.
//!
//! [`write_rules`] writes a changed rule set back into the file with `toml_edit`, keeping the
//! rest of the document (comments, formatting, other tables) as it is.
//!
//! # Layout
//! - `model.rs`: the typed config ([`Config`], [`AgentConfig`], [`ClusterConfig`]), the limits
//!   and defaults.
//! - `keywords.rs`: the settings spelled as words ([`AttachMode`], [`Action`], [`Protocol`],
//!   [`TcpFlags`], [`Scope`], [`Per`]).
//! - `rule.rs`: one rule ([`RuleConfig`], [`LimitConfig`]) and its serialized form.
//! - `validate.rs`: the checks of one rule ([`RuleConfig::validate`]) and [`RuleError`].
//! - `raw.rs`: the file as written (serde's view, each value with its position); `parse.rs`: TOML
//!   text to the model through it.
//! - `cluster.rs`: the `[cluster]` table from its raw form; `redis.rs`: its Redis keys.
//! - `lists.rs`: the files a config names: its own text, `source_file` lists, relative paths.
//! - `write.rs`: writing a changed rule set back into the file; a rule as TOML.
//! - `error.rs`: [`ConfigError`], the positions errors name, and locating a TOML error's key.
//!
//! `model.rs`, `keywords.rs`, `rule.rs`, `validate.rs` and `error.rs` import no other file of the
//! folder but each other; `lists.rs` imports those, and `parse.rs` and `write.rs` import them all.
//! `raw.rs` imports the keywords; `cluster.rs` and `redis.rs` import some of the model's files and
//! `raw.rs`'s `RawCluster`, which they convert for `parse.rs`.

mod cluster;
mod error;
mod keywords;
mod lists;
mod model;
mod parse;
mod raw;
mod redis;
mod rule;
mod validate;
mod write;

pub use self::{
    error::*,
    keywords::*,
    lists::*,
    model::*,
    redis::{
        check_url as check_redis_url, read_ca as read_redis_ca,
        read_password as read_redis_password,
    },
    rule::*,
    validate::*,
    write::*,
};

#[cfg(test)]
mod tests;
