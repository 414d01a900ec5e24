//! `ratelimit`: the agent and its command-line client, as one thin binary (in the manner of
//! mini-redis's `server`/`cli`): this file only parses the command line (clap) and calls the
//! library.
//!
//! - `ratelimit agent` -> [`ratelimit::daemon::run`], which starts the agent's state
//!   ([`ratelimit::agent`]) and the servers around it.
//! - `ratelimit check`, `stats --pin-path`, `detach --pin-path` work without an agent: straight on
//!   the config ([`ratelimit::config`], [`ratelimit::compile`]) or the pinned maps
//!   ([`ratelimit::maps`], [`ratelimit::dataplane`]).
//! - Every other command asks the running agent over its control socket
//!   ([`ratelimit::client`]) and prints the answer as a table ([`ratelimit::render`]) or JSON.
//! - `completions` and the hidden `manpages` are generated from these clap definitions.

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use ratelimit::{
    agent::AgentOptions,
    client::{Client, ClientError},
    config::{AttachMode, Config, DEFAULT_SOCKET},
    daemon, dataplane,
    maps::PinnedMaps,
    render,
    stats::StatsReport,
};

/// Per-source packet rate limiting in XDP.
#[derive(Parser, Debug)]
#[command(name = "ratelimit", version, about)]
struct Cli {
    /// Control socket of the agent (client commands).
    #[arg(long, global = true, default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Log format on stderr: plain (default; journald-friendly) or json (one object per line).
    /// For the agent, overrides `[agent] log_format`.
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    log_format: Option<ratelimit::logging::LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the agent: validate the config, load the XDP program, install the rules, attach.
    Agent {
        /// Config file (TOML).
        #[arg(short, long, default_value = "/etc/ratelimit/ratelimit.toml")]
        config: PathBuf,
        /// Interface to attach to (repeatable); replaces the config's `interfaces`.
        #[arg(long = "iface")]
        ifaces: Vec<String>,
        /// XDP mode: auto (native, falling back to generic), native, or skb (generic).
        #[arg(long, value_parser = parse_mode)]
        mode: Option<AttachMode>,
        /// On exit, leave the limiter attached and its state pinned, for a restart or upgrade:
        /// the next agent adopts it without a gap.
        #[arg(long)]
        keep_attached: bool,
        /// Where to keep what the agent learns across restarts; replaces the config's
        /// `state_dir`.
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },
    /// Validate a config file (and its list files) and print how many rules and prefixes it
    /// compiles to; changes nothing.
    Check {
        /// Config file (TOML).
        #[arg(short, long, default_value = "/etc/ratelimit/ratelimit.toml")]
        config: PathBuf,
    },
    /// Show the running agent: interfaces, rules, buckets, reloads.
    Status {
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show the cluster's members (state, last heard, lag), the heaviest keys' holders (each
    /// one's demand and share) and the gossip counters.
    Peers {
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List, add or remove the rules in force, or reload them from the config file.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
    },
    /// Show per-rule and global counters.
    Stats {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Refresh every second until interrupted (with --json: one line per second).
        #[arg(long)]
        watch: bool,
        /// Read the pinned maps in this directory directly instead of asking the agent (works
        /// while no agent runs, e.g. `--pin-path /sys/fs/bpf/ratelimit`).
        #[arg(long, value_name = "DIR")]
        pin_path: Option<PathBuf>,
    },
    /// The sources using the most right now: packets passed and dropped per second, bucket level.
    Top {
        /// How many buckets to show.
        #[arg(short, default_value_t = 10)]
        n: usize,
        /// Measure over this many milliseconds.
        #[arg(long, default_value_t = 1000, value_name = "MS")]
        interval_ms: u64,
        /// Only the buckets of this limit of their rule: 1 its own, 2.. its `[[rule.limit]]`s
        /// (e.g. the /24s of a rule whose second limit is per = "/24"). Default: every limit.
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Refresh until interrupted.
        #[arg(long)]
        watch: bool,
    },
    /// Which rule a packet from IP falls under and why, and its bucket's current level.
    Explain {
        /// Source address of the packet.
        ip: String,
        /// Its protocol: tcp, udp, icmp or a protocol number (default: none in particular).
        #[arg(long)]
        protocol: Option<String>,
        /// Its destination port (with --protocol tcp or udp).
        #[arg(long)]
        dst_port: Option<u16>,
        /// The TCP flags it carries (with --protocol tcp): names joined by commas, e.g. syn,
        /// syn,ack or ack (default: none, which no flag rule matches).
        #[arg(long, value_name = "FLAGS")]
        tcp_flags: Option<String>,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Limits learned from the traffic: per rule and limit, the distribution of what each source
    /// sent (10 s and 1 s peak rates, bursts), the proposed rate and burst, what they would have
    /// limited (and the heaviest sources among them), and the TOML for them.
    Suggest {
        /// Only this rule.
        #[arg(long, value_name = "NAME")]
        rule: Option<String>,
        /// The share of the sources the limit lets through untouched, in (0, 1].
        #[arg(long, value_name = "Q", default_value = "0.99")]
        quantile: String,
        /// Factor over the observed quantile, at least 1.
        #[arg(long, value_name = "X", default_value = "1.5")]
        headroom: String,
        /// How far back: e.g. 30m, 1h (default), 6h, 1d (at most a day).
        #[arg(long, value_name = "DUR", default_value = "1h")]
        since: String,
        /// Set each proposed rate and burst, as `rules add` sets a rule: validated, applied whole,
        /// written back to the config file.
        #[arg(long)]
        apply: bool,
        /// With --apply: write even if the config file's rules are not those in force.
        #[arg(long, requires = "apply")]
        force: bool,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove the XDP program from an interface (default: from every interface).
    Detach {
        /// Interface to detach from.
        #[arg(long)]
        iface: Option<String>,
        /// If no agent answers, remove the pinned links (and, without --iface, the maps) a
        /// stopped or killed agent left in this directory, which detaches its program.
        #[arg(long, value_name = "DIR")]
        pin_path: Option<PathBuf>,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script, e.g. `ratelimit completions bash > /etc/bash_completion.d/ratelimit`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages into DIR (for packaging).
    #[command(hide = true)]
    Manpages {
        /// Directory to write them to.
        dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum RulesCommand {
    /// List the rules in force, with the config file's keys.
    List {
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Add a rule: validated with the rules in force, applied whole, written to the config file.
    Add(Box<AddArgs>),
    /// Remove the rule named NAME.
    Remove {
        /// Rule name.
        name: String,
        /// Write the change even if the config file's rules are not those in force (an edit not
        /// loaded yet is then lost).
        #[arg(long)]
        force: bool,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-read the config file and apply it (refused whole if anything in it is invalid).
    Reload {
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
}

/// A rule's keys, as in a `[[rule]]` table of the config file; keys left out take its defaults.
#[derive(clap::Args, Debug)]
struct AddArgs {
    /// Unique name: letters, digits, '_', '.', '-'.
    #[arg(long)]
    name: String,
    /// Source CIDR (or address); repeat for several prefixes.
    #[arg(long, required = true, value_name = "CIDR")]
    source: Vec<String>,
    /// Packets per second (limit rules).
    #[arg(long)]
    rate: Option<u64>,
    /// Packets (default: the rate).
    #[arg(long)]
    burst: Option<u64>,
    /// Bucket granularity: source, rule, or a prefix length such as /24.
    #[arg(long)]
    per: Option<String>,
    /// tcp, udp, icmp or any (default).
    #[arg(long)]
    protocol: Option<String>,
    /// Destination port (with --protocol tcp or udp).
    #[arg(long, value_name = "PORT")]
    dst_port: Option<u64>,
    /// TCP flags to match (with --protocol tcp): syn (SYN set, ACK clear).
    #[arg(long, value_name = "FLAGS")]
    tcp_flags: Option<String>,
    /// limit (default), allow or deny.
    #[arg(long)]
    action: Option<String>,
    /// local (default) or cluster.
    #[arg(long)]
    scope: Option<String>,
    /// Bytes per second (limit rules).
    #[arg(long)]
    bytes_rate: Option<u64>,
    /// Bytes (default: max(bytes rate, 65536)).
    #[arg(long)]
    bytes_burst: Option<u64>,
    /// Count the would-be drops but pass the packets.
    #[arg(long)]
    dry_run: bool,
    /// A further limit of the rule (a `[[rule.limit]]`), as comma-separated KEY=VALUE pairs:
    /// per (required), rate, burst, bytes_rate, bytes_burst, scope; e.g.
    /// `--limit per=/24,rate=20000`. Repeat for up to three.
    #[arg(long, value_name = "KEY=VALUE,...")]
    limit: Vec<String>,
    /// Print the API's JSON.
    #[arg(long)]
    json: bool,
    /// Write the change even if the config file's rules are not those in force (an edit not
    /// loaded yet is then lost).
    #[arg(long)]
    force: bool,
}

impl AddArgs {
    /// The `limit` array of `POST /v1/rules` from the `--limit` flags (the agent checks keys and
    /// values; numbers are sent as numbers).
    fn limits_json(&self) -> Result<Vec<serde_json::Value>, String> {
        self.limit
            .iter()
            .map(|spec| {
                let mut obj = serde_json::Map::new();
                for pair in spec.split(',').filter(|p| !p.trim().is_empty()) {
                    let (k, v) = pair
                        .split_once('=')
                        .ok_or_else(|| format!("--limit {spec:?}: {pair:?} is not KEY=VALUE"))?;
                    let (k, v) = (k.trim(), v.trim());
                    let value = match k {
                        "rate" | "burst" | "bytes_rate" | "bytes_burst" => v
                            .parse::<u64>()
                            .map(serde_json::Value::from)
                            .map_err(|_| format!("--limit {spec:?}: {k} {v:?} is not a number"))?,
                        _ => v.into(),
                    };
                    obj.insert(k.to_string(), value);
                }
                Ok(serde_json::Value::Object(obj))
            })
            .collect()
    }

    /// The rule object of `POST /v1/rules`: only the keys given, so the agent fills in defaults.
    fn to_json(&self) -> serde_json::Value {
        let mut rule = serde_json::Map::new();
        let mut put = |key: &str, v: serde_json::Value| {
            rule.insert(key.to_string(), v);
        };
        put("name", self.name.clone().into());
        put(
            "source",
            match self.source.as_slice() {
                [one] => one.clone().into(),
                many => many.to_vec().into(),
            },
        );
        for (key, v) in [
            ("rate", self.rate),
            ("burst", self.burst),
            ("dst_port", self.dst_port),
            ("bytes_rate", self.bytes_rate),
            ("bytes_burst", self.bytes_burst),
        ] {
            if let Some(v) = v {
                put(key, v.into());
            }
        }
        for (key, v) in [
            ("per", &self.per),
            ("protocol", &self.protocol),
            ("tcp_flags", &self.tcp_flags),
            ("action", &self.action),
            ("scope", &self.scope),
        ] {
            if let Some(v) = v {
                put(key, v.clone().into());
            }
        }
        if self.dry_run {
            put("dry_run", true.into());
        }
        match self.limits_json() {
            Ok(limits) if limits.is_empty() => {}
            Ok(limits) => put("limit", limits.into()),
            // Sent as written: the agent names the key at fault.
            Err(e) => put("limit", e.into()),
        }
        serde_json::Value::Object(rule)
    }
}

fn parse_mode(s: &str) -> Result<AttachMode, String> {
    match s {
        "auto" => Ok(AttachMode::Auto),
        "native" => Ok(AttachMode::Native),
        "skb" => Ok(AttachMode::Skb),
        _ => Err(format!("unknown mode {s:?}: expected auto, native or skb")),
    }
}

fn main() -> ExitCode {
    // The agent's big transient buffers (a walk of the bucket map for `top`: tens of MiB with a
    // million sources) must go back to the system when freed. glibc raises its mmap threshold
    // after the first such free and then serves them from per-thread arenas, which keep the
    // memory: the soak saw the agent's resident memory climb from 47 to 78 MiB and stay. A fixed
    // threshold keeps every allocation of 256 KiB or more in its own mapping, unmapped on free.
    #[cfg(target_env = "gnu")]
    // SAFETY: a malloc tuning call with a valid parameter, before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
    }
    let cli = Cli::parse();
    let agent_config = match &cli.command {
        Command::Agent { config, .. } => Some(config.as_path()),
        _ => None,
    };
    let log_format = ratelimit::logging::choose(cli.log_format, agent_config);
    ratelimit::logging::init(log_format);
    // Like any Unix filter: a closed pipe (`ratelimit stats --json | head`) ends a client
    // command quietly instead of panicking in println!. Not the agent: a client that closes its
    // connection before the answer (control socket, metrics) would kill it with SIGPIPE.
    if !matches!(cli.command, Command::Agent { .. }) {
        // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // With `--log-format json` the last word is a JSON record too: a collector reading
            // the agent's stderr must be able to parse every line, the fatal one above all.
            if log_format == ratelimit::logging::LogFormat::Json {
                tracing::error!(error = %error_chain(&e), "exiting");
            } else {
                eprintln!("error: {}", error_chain(&e));
            }
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, `: `-separated, leaving out a cause whose text the line
/// already holds (many errors name their OS cause in their own message and also return it as
/// their source, which `{:#}` would print twice).
fn error_chain(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !line.contains(&cause) {
            line.push_str(": ");
            line.push_str(&cause);
        }
    }
    line
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Agent {
            config,
            ifaces,
            mode,
            keep_attached,
            state_dir,
        } => {
            let opts = AgentOptions {
                config_path: config,
                interfaces: ifaces,
                mode,
                keep_attached,
                state_dir,
            };
            let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            rt.block_on(daemon::run(opts))?;
            Ok(())
        }
        Command::Check { config } => {
            let cfg = Config::load(&config)?;
            let set = ratelimit::compile::compile(&cfg.rules, &ratelimit::compile::RuleIds::new())
                .with_context(|| format!("{}", config.display()))?;
            for w in cfg
                .rules
                .iter()
                .flat_map(ratelimit::config::tcp_burst_warnings)
            {
                eprintln!("warning: {}: {w}", config.display());
            }
            println!(
                "{}: ok: {} rules, {} prefixes",
                config.display(),
                set.rules.len(),
                set.prefixes.len()
            );
            Ok(())
        }
        Command::Stats {
            json,
            watch,
            pin_path: Some(dir),
        } => loop {
            let report = StatsReport::read(&PinnedMaps::open(&dir)?)?;
            print_stats(&serde_json::to_value(&report)?, json, watch);
            if !watch {
                return Ok(());
            }
            std::thread::sleep(Duration::from_secs(1));
        },
        Command::Detach {
            iface,
            pin_path,
            json,
        } => {
            let client = Client::new(&cli.socket);
            match block_on(client.detach(iface.as_deref())) {
                Err(e) if e.is_unreachable() && pin_path.is_some() => {
                    let dir = pin_path.expect("checked");
                    detach_offline(&dir, iface.as_deref(), &e)
                }
                answer => {
                    let v = answer?;
                    print_answer(&v, json, render::detached);
                    Ok(())
                }
            }
        }
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "ratelimit",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Manpages { dir } => {
            use clap::CommandFactory as _;
            for page in ratelimit::manpages::write_all(&Cli::command(), &dir)? {
                println!("{}", page.display());
            }
            Ok(())
        }
        client_command => block_on(run_client(&Client::new(&cli.socket), client_command)),
    }
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime starts")
        .block_on(f)
}

fn print_answer(v: &serde_json::Value, json: bool, human: fn(&serde_json::Value) -> String) {
    if json {
        println!("{v}");
    } else {
        print!("{}", human(v));
    }
}

fn print_stats(v: &serde_json::Value, json: bool, watch: bool) {
    if json {
        println!("{v}");
    } else {
        if watch {
            print!("\x1b[2J\x1b[H");
        }
        print!("{}", render::stats(v));
    }
}

/// The commands answered by the agent over its socket.
async fn run_client(client: &Client, command: Command) -> anyhow::Result<()> {
    match command {
        Command::Status { json } => print_answer(&client.status().await?, json, render::status),
        Command::Peers { json } => print_answer(&client.cluster().await?, json, render::peers),
        Command::Rules { command } => match command {
            RulesCommand::List { json } => {
                print_answer(&client.rules().await?, json, render::rules)
            }
            RulesCommand::Add(args) => {
                print_answer(
                    &client.add_rule(&args.to_json(), args.force).await?,
                    args.json,
                    render::added,
                );
            }
            RulesCommand::Remove { name, force, json } => {
                print_answer(
                    &client.remove_rule(&name, force).await?,
                    json,
                    render::removed,
                );
            }
            RulesCommand::Reload { json } => {
                print_answer(&client.reload().await?, json, render::reloaded)
            }
        },
        Command::Stats { json, watch, .. } => loop {
            print_stats(&client.stats().await?, json, watch);
            if !watch {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        },
        Command::Top {
            n,
            interval_ms,
            limit,
            json,
            watch,
        } => loop {
            let v = client.top(n, interval_ms, limit).await?;
            if watch && !json {
                print!("\x1b[2J\x1b[H");
            }
            print_answer(&v, json, render::top);
            if !watch {
                break;
            }
        },
        Command::Explain {
            ip,
            protocol,
            dst_port,
            tcp_flags,
            json,
        } => {
            let v = client
                .explain(&ip, protocol.as_deref(), dst_port, tcp_flags.as_deref())
                .await?;
            print_answer(&v, json, render::explain);
        }
        Command::Suggest {
            rule,
            quantile,
            headroom,
            since,
            apply,
            force,
            json,
        } => {
            let since = ratelimit::learn::suggest::parse_since(&since)
                .map_err(|e| anyhow::anyhow!("--since: {e}"))?;
            let query = ratelimit::api::suggest_query(
                rule.as_deref(),
                Some(&quantile),
                Some(&headroom),
                Some(&since.to_string()),
            )
            .map_err(|e| anyhow::anyhow!("--{e}"))?;
            let v = client.suggest(&query).await?;
            if json {
                println!("{}", v["suggestions"]);
            } else {
                print!("{}", render::suggest(&v));
            }
            if apply {
                suggest_apply(client, &v, force).await?;
            }
        }
        Command::Agent { .. }
        | Command::Check { .. }
        | Command::Detach { .. }
        | Command::Completions { .. }
        | Command::Manpages { .. } => {
            unreachable!("handled by run()")
        }
    }
    Ok(())
}

/// `suggest --apply`: each proposal set through the agent, one after the other (each validated,
/// applied and written back as a `rules add` is); stops at the first refused.
async fn suggest_apply(client: &Client, v: &serde_json::Value, force: bool) -> anyhow::Result<()> {
    for s in v["suggestions"].as_array().into_iter().flatten() {
        let (rule, limit) = (
            s["rule"].as_str().unwrap_or(""),
            s["limit"].as_u64().unwrap_or(0),
        );
        let (rate, burst) = (
            s["proposed"]["rate"].as_u64().unwrap_or(0),
            s["proposed"]["burst"].as_u64().unwrap_or(0),
        );
        client
            .apply_limit(rule, (limit, rate, burst), force)
            .await
            .with_context(|| format!("applying rule {rule:?} limit {limit}"))?;
        eprintln!("applied: rule {rule:?} limit {limit}: rate {rate}, burst {burst}");
    }
    Ok(())
}

/// `detach --pin-path DIR` with no agent running: removing a pinned link releases it, which
/// detaches the program from its interface; without --iface the maps go too.
fn detach_offline(
    dir: &Path,
    iface: Option<&str>,
    unreachable: &ClientError,
) -> anyhow::Result<()> {
    if let ClientError::Unreachable { socket, .. } = unreachable {
        eprintln!(
            "no agent answers at {} ({}): detaching with what is pinned in {}",
            socket.display(),
            unreachable.unreachable_reason().unwrap_or_default(),
            dir.display()
        );
    }
    if std::fs::symlink_metadata(dir).is_err() {
        anyhow::bail!("nothing to detach: {} does not exist", dir.display());
    }
    dataplane::check_own_pin_dir(dir)?;
    match iface {
        Some(iface) => {
            let link = dir.join(dataplane::link_pin_name(iface));
            std::fs::remove_file(&link).with_context(|| {
                format!(
                    "removing {} (the pinned XDP link of {iface})",
                    link.display()
                )
            })?;
            println!("removed {}: XDP detached from {iface}", link.display());
        }
        None => {
            dataplane::remove_pin_dir(dir)?;
            println!(
                "removed the pinned links and maps in {}: XDP detached",
                dir.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("{path}: cannot read config file: {source}")]
    struct Read {
        path: &'static str,
        source: std::io::Error,
    }

    #[test]
    fn an_os_cause_named_in_the_message_is_printed_once() {
        let io = std::io::Error::from_raw_os_error(2);
        let e = anyhow::Error::new(Read {
            path: "/x.toml",
            source: io,
        });
        let line = error_chain(&e);
        assert_eq!(line.matches("os error 2").count(), 1, "{line}");
        // A cause the message does not name is kept.
        let e = anyhow::Error::new(std::io::Error::from_raw_os_error(13)).context("opening /x");
        assert_eq!(
            error_chain(&e),
            format!("opening /x: {}", std::io::Error::from_raw_os_error(13))
        );
    }
}
