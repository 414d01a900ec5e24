//! ratelimit: the user-space half of the XDP rate limiter.
//!
//! # How data flows
//! - **Rules:** config file -> [`config`] (parsed and validated, errors with file:line:key) ->
//!   [`compile`] (rule ids, records and prefix tries the XDP program reads) -> [`dataplane`]
//!   (installed into the pinned maps and swapped in atomically) -> [`maps`] (typed access to the
//!   pinned maps).
//! - **Packets** never come here: the XDP program (crate `ratelimit-ebpf`) parses each one,
//!   classifies it by source prefix, protocol and port, and charges its bucket in the pinned bucket
//!   store. User space reads the counters and buckets back ([`stats`], [`maps::bucket`]) and, in a
//!   cluster, charges them for what peers admitted ([`cluster`]).
//!
//! # Layers, bottom up
//! 1. [`config`], [`compile`], [`maps`], [`stats`]: plain data and the pinned maps; no runtime.
//! 2. [`dataplane`]: loads and attaches the program, installs rule sets.
//! 3. [`agent`]: the agent's state (the config and rules in force, reloads, `status`,
//!    `explain`, detach, shutdown). It imports nothing above it.
//! 4. The servers, each handed only what it needs: [`api`] (the control API on a Unix socket),
//!    [`metrics`] (Prometheus), both served by [`http`] (connection cap, timeouts) and reading
//!    the bucket count from [`census`] (a paced walk of the bucket store off the agent's lock),
//!    [`cluster`] (gossip and charging; it reads the rules in force and its own handles on the
//!    pinned maps, never the agent).
//! 5. [`daemon`]: `ratelimit agent`: starts the agent, runs the servers, the watchers and the
//!    signals, and shuts it all down.
//!
//! Beside them, for the CLI: [`client`] (the API's client) and [`render`] (its tables); for
//! running as a system daemon: [`logging`] (log format), [`notify`] (systemd's readiness
//! protocol), [`manpages`]. The binary (`main.rs`) only parses the command line and calls into
//! these.
pub mod agent;
pub mod api;
pub mod census;
pub mod client;
pub mod cluster;
pub mod compile;
pub mod config;
pub mod daemon;
pub mod dataplane;
pub mod http;
pub mod learn;
pub mod logging;
pub mod manpages;
pub mod maps;
pub mod metrics;
pub mod notify;
pub mod render;
pub mod stats;
