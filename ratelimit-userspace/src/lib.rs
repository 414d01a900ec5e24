//! ratelimit: the user-space half of the XDP rate limiter.
//!
//! # Layout
//! - [`agent`]: the agent's life cycle: validate, load, install, attach, detach on shutdown.
//! - [`config`]: the TOML config file, parsed and validated with file/line/field errors.
//! - [`compile`]: turns validated rules into the records the XDP program reads (rule ids, prefix
//!   candidate lists), and a user-space reference classifier with the same semantics.
//! - [`maps`]: typed access to the pinned maps (rules, prefixes, buckets, counters).
//! - [`dataplane`]: loads and attaches the XDP program and swaps rule sets in atomically.
//! - [`api`]: the control API (HTTP/JSON on a root-only Unix socket): routes and JSON shapes.
//! - [`client`]: the API's client, used by the CLI; [`render`]: its human output (tables).
//! - [`cluster`]: cluster-wide budgets: gossip (chitchat, authenticated) of heavy sources'
//!   consumption, charged into the local buckets.
//! - [`stats`]: counter reports for `ratelimit stats` (table and JSON).
//! - [`logging`], [`notify`], [`manpages`]: running as a system daemon: log format, systemd's
//!   readiness protocol, man pages.
pub mod agent;
pub mod api;
pub mod client;
pub mod cluster;
pub mod compile;
pub mod config;
pub mod dataplane;
pub mod logging;
pub mod manpages;
pub mod maps;
pub mod metrics;
pub mod notify;
pub mod render;
pub mod stats;
