//! `[cluster]`: the backend, the gossip keys (`key_file`, `listen`), the sync interval, the
//! cluster's name and size, and what a host cut off from the others does, each checked where it
//! was written. The Redis keys are `redis.rs`'s.

use std::{ops::RangeInclusive, path::PathBuf};

use toml::Spanned;

use super::{
    error::{ConfigError, Source},
    model::{ClusterBackend, ClusterConfig, OnPartition, DEFAULT_PARTITION_MEMORY_S, MAX_KEYS},
    raw::RawCluster,
    redis::redis_from_raw,
    validate::validate_name,
};

const S: &str = "[cluster]";

/// The `[cluster]` table. Its keys are checked in this order, whatever the order they are written
/// in: `backend`, the Redis keys, `key_file`, `listen`, `sync_interval_ms`, `cluster_id`,
/// `max_keys`, `on_partition`, `partition_memory_s`.
pub(super) fn cluster_from_raw(
    src: &Source,
    raw: Spanned<RawCluster>,
) -> Result<ClusterConfig, ConfigError> {
    let table_at = raw.span().start;
    let raw = raw.into_inner();
    let backend = backend_from_raw(src, &raw)?;
    let redis = redis_from_raw(src, &raw, backend)?;
    let key_file = key_file_from_raw(src, &raw, backend, table_at)?;
    if raw.listen.is_none() && backend == ClusterBackend::Gossip {
        return Err(src.invalid(
            table_at,
            S,
            "listen",
            "missing: backend = \"gossip\" (the default) needs this host's gossip address",
        ));
    }
    let sync_interval_ms = sync_interval_from_raw(src, raw.sync_interval_ms)?;
    let cluster_id = cluster_id_from_raw(src, raw.cluster_id)?;
    let max_keys = max_keys_from_raw(src, raw.max_keys)?;
    let (on_partition, partition_memory_s) = partition_from_raw(
        src,
        raw.on_partition,
        raw.partition_memory_s,
        backend,
        table_at,
    )?;
    Ok(ClusterConfig {
        backend,
        listen: raw.listen,
        seeds: raw.seeds.unwrap_or_default(),
        key_file,
        redis,
        sync_interval_ms,
        cluster_id,
        max_keys,
        on_partition,
        partition_memory_s,
    })
}

/// `backend`: `"gossip"` (the default) or `"redis"`.
fn backend_from_raw(src: &Source, raw: &RawCluster) -> Result<ClusterBackend, ConfigError> {
    Ok(match &raw.backend {
        None => ClusterBackend::Gossip,
        Some(v) => match v.get_ref().as_str() {
            "gossip" => ClusterBackend::Gossip,
            "redis" => ClusterBackend::Redis,
            other => {
                return Err(src.invalid(
                    v.span().start,
                    S,
                    "backend",
                    format!("must be \"gossip\" or \"redis\" (got {other:?})"),
                ))
            }
        },
    })
}

/// `key_file`: not empty when written; required under gossip (reported at the table, `table_at`),
/// optional under Redis.
fn key_file_from_raw(
    src: &Source,
    raw: &RawCluster,
    backend: ClusterBackend,
    table_at: usize,
) -> Result<Option<PathBuf>, ConfigError> {
    Ok(match (&raw.key_file, backend) {
        (Some(k), _) if k.get_ref().as_os_str().is_empty() => {
            return Err(src.invalid(k.span().start, S, "key_file", "must not be empty"));
        }
        (Some(k), _) => Some(k.get_ref().clone()),
        (None, ClusterBackend::Gossip) => {
            return Err(src.invalid(
                table_at,
                S,
                "key_file",
                "missing: backend = \"gossip\" (the default) needs the cluster's key file",
            ));
        }
        (None, ClusterBackend::Redis) => None,
    })
}

/// `sync_interval_ms`: 10 to 10000, 100 when not written.
fn sync_interval_from_raw(src: &Source, v: Option<Spanned<i64>>) -> Result<u64, ConfigError> {
    ranged(
        src,
        v,
        "sync_interval_ms",
        10..=10_000,
        " milliseconds",
        100,
    )
}

/// An integer key of `[cluster]` (`v`, as written): `default` when not written, else within
/// `range`, refused otherwise with the range and its `unit` (" seconds", or "" for a count).
fn ranged(
    src: &Source,
    v: Option<Spanned<i64>>,
    key: &str,
    range: RangeInclusive<i64>,
    unit: &str,
    default: u64,
) -> Result<u64, ConfigError> {
    let Some(v) = v else {
        return Ok(default);
    };
    let n = *v.get_ref();
    if !range.contains(&n) {
        return Err(src.invalid(
            v.span().start,
            S,
            key,
            format!(
                "must be between {} and {}{unit} (got {n})",
                range.start(),
                range.end()
            ),
        ));
    }
    Ok(n.unsigned_abs())
}

/// `cluster_id`: a valid name, `"ratelimit"` when not written.
fn cluster_id_from_raw(src: &Source, id: Option<Spanned<String>>) -> Result<String, ConfigError> {
    Ok(match id {
        None => "ratelimit".to_owned(),
        Some(id) => {
            validate_name(id.get_ref())
                .map_err(|m| src.invalid(id.span().start, S, "cluster_id", m))?;
            id.into_inner()
        }
    })
}

/// `max_keys`: 1 to 100000, [`MAX_KEYS`] when not written.
fn max_keys_from_raw(src: &Source, v: Option<Spanned<i64>>) -> Result<usize, ConfigError> {
    let n = ranged(src, v, "max_keys", 1..=100_000, "", MAX_KEYS as u64)?;
    Ok(usize::try_from(n).expect("bounded above"))
}

/// `on_partition` (`"fail_open"`, the default, or `"share"`, which only gossip allows) and
/// `partition_memory_s` (1 to 86400, [`DEFAULT_PARTITION_MEMORY_S`] when not written).
fn partition_from_raw(
    src: &Source,
    on_partition_raw: Option<Spanned<String>>,
    memory_raw: Option<Spanned<i64>>,
    backend: ClusterBackend,
    table_at: usize,
) -> Result<(OnPartition, u64), ConfigError> {
    let on_partition = match &on_partition_raw {
        None => OnPartition::FailOpen,
        Some(v) => match v.get_ref().as_str() {
            "fail_open" => OnPartition::FailOpen,
            "share" => OnPartition::Share,
            other => {
                return Err(src.invalid(
                    v.span().start,
                    S,
                    "on_partition",
                    format!("must be \"fail_open\" or \"share\" (got {other:?})"),
                ))
            }
        },
    };
    let partition_memory_s = ranged(
        src,
        memory_raw,
        "partition_memory_s",
        1..=86_400,
        " seconds",
        DEFAULT_PARTITION_MEMORY_S,
    )?;
    if backend == ClusterBackend::Redis && on_partition == OnPartition::Share {
        let at = on_partition_raw
            .as_ref()
            .map_or(table_at, |v| v.span().start);
        return Err(src.invalid(
            at,
            S,
            "on_partition",
            "\"share\" needs backend = \"gossip\" (under Redis a host that cannot reach the \
             store enforces alone: fail_open)",
        ));
    }
    Ok((on_partition, partition_memory_s))
}
