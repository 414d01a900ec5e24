//! The config file as written: what serde reads from the TOML, every value still with its
//! position (`Spanned`) so that an error can name its line and key. `parse.rs`, `cluster.rs` and
//! `redis.rs` turn it into the model, checking each value.

use std::{fmt, net::SocketAddr, path::PathBuf};

use serde::Deserialize;
use toml::Spanned;

use super::{Action, AttachMode, LogFormat, Per, Protocol, Scope, TcpFlags};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) agent: Option<RawAgent>,
    #[serde(default, rename = "rule")]
    pub(super) rules: Vec<Spanned<RawRule>>,
    pub(super) cluster: Option<Spanned<RawCluster>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAgent {
    pub(super) interfaces: Option<Vec<Spanned<String>>>,
    pub(super) mode: Option<AttachMode>,
    pub(super) socket: Option<Spanned<PathBuf>>,
    pub(super) metrics: Option<SocketAddr>,
    pub(super) max_buckets: Option<Spanned<i64>>,
    pub(super) pin_path: Option<Spanned<PathBuf>>,
    pub(super) dry_run: Option<bool>,
    pub(super) ebpf_log: Option<bool>,
    pub(super) log_format: Option<LogFormat>,
    pub(super) state_dir: Option<Spanned<PathBuf>>,
    pub(super) learn: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    pub(super) backend: Option<Spanned<String>>,
    pub(super) listen: Option<SocketAddr>,
    pub(super) seeds: Option<Vec<SocketAddr>>,
    pub(super) key_file: Option<Spanned<PathBuf>>,
    pub(super) redis: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) redis_user: Option<Spanned<String>>,
    pub(super) redis_password_file: Option<Spanned<PathBuf>>,
    pub(super) redis_ca_file: Option<Spanned<PathBuf>>,
    pub(super) redis_connect_timeout_ms: Option<Spanned<i64>>,
    pub(super) redis_command_timeout_ms: Option<Spanned<i64>>,
    pub(super) sync_interval_ms: Option<Spanned<i64>>,
    pub(super) cluster_id: Option<Spanned<String>>,
    pub(super) max_keys: Option<Spanned<i64>>,
    pub(super) on_partition: Option<Spanned<String>>,
    pub(super) partition_memory_s: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    pub(super) name: Spanned<String>,
    pub(super) source: Option<Spanned<RawSource>>,
    pub(super) source_file: Option<Spanned<PathBuf>>,
    pub(super) action: Option<Spanned<Action>>,
    pub(super) rate: Option<Spanned<i64>>,
    pub(super) burst: Option<Spanned<i64>>,
    pub(super) bytes_rate: Option<Spanned<i64>>,
    pub(super) bytes_burst: Option<Spanned<i64>>,
    pub(super) per: Option<Spanned<Per>>,
    pub(super) protocol: Option<Spanned<Protocol>>,
    pub(super) dst_port: Option<Spanned<i64>>,
    pub(super) tcp_flags: Option<Spanned<TcpFlags>>,
    pub(super) scope: Option<Spanned<Scope>>,
    pub(super) dry_run: Option<Spanned<bool>>,
    pub(super) limit: Option<Vec<Spanned<RawLimit>>>,
}

/// One `[[rule.limit]]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimit {
    pub(super) per: Option<Spanned<Per>>,
    pub(super) rate: Option<Spanned<i64>>,
    pub(super) burst: Option<Spanned<i64>>,
    pub(super) bytes_rate: Option<Spanned<i64>>,
    pub(super) bytes_burst: Option<Spanned<i64>>,
    pub(super) scope: Option<Spanned<Scope>>,
}

/// A rule's `source` as written: one CIDR or an array of them.
pub(super) enum RawSource {
    One(String),
    Many(Vec<Spanned<String>>),
}

impl<'de> Deserialize<'de> for RawSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RawSource;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a CIDR string or an array of CIDR strings")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<RawSource, E> {
                Ok(RawSource::One(s.to_owned()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<RawSource, A::Error> {
                let mut list = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(item) = seq.next_element::<Spanned<String>>()? {
                    list.push(item);
                }
                Ok(RawSource::Many(list))
            }
        }
        d.deserialize_any(Visitor)
    }
}
