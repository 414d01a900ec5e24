//! `ratelimit`: the agent and its command-line client.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use ratelimit::{
    agent::{self, AgentOptions},
    config::{AttachMode, Config, DEFAULT_PIN_PATH, DEFAULT_SOCKET},
    maps::PinnedMaps,
    stats::StatsReport,
};

/// Per-source packet rate limiting in XDP.
#[derive(Parser, Debug)]
#[command(name = "ratelimit", version, about)]
struct Cli {
    /// Control socket of the agent (client commands).
    #[arg(long, global = true, default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
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
    },
    /// Validate a config file and print the compiled rules; changes nothing.
    Check {
        /// Config file (TOML).
        #[arg(short, long, default_value = "/etc/ratelimit/ratelimit.toml")]
        config: PathBuf,
    },
    /// Show per-rule and global counters, read from the pinned maps.
    Stats {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Refresh every second until interrupted.
        #[arg(long)]
        watch: bool,
        /// Pin directory of the agent's maps.
        #[arg(long, default_value = DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
    },
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Agent { config, ifaces, mode, keep_attached } => {
            let opts = AgentOptions { config_path: config, interfaces: ifaces, mode, keep_attached };
            let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            rt.block_on(agent::run(opts))?;
            Ok(())
        }
        Command::Check { config } => {
            let cfg = Config::load(&config)?;
            let set = ratelimit::compile::compile(&cfg.rules, &ratelimit::compile::RuleIds::new())
                .with_context(|| format!("{}", config.display()))?;
            println!(
                "{}: ok: {} rules, {} prefixes",
                config.display(),
                set.rules.len(),
                set.prefixes.len()
            );
            Ok(())
        }
        Command::Stats { json, watch, pin_path } => loop {
            let maps = PinnedMaps::open(&pin_path)?;
            let report = StatsReport::read(&maps)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                if watch {
                    print!("\x1b[2J\x1b[H");
                }
                print!("{}", report.to_table());
            }
            if !watch {
                return Ok(());
            }
            std::thread::sleep(Duration::from_secs(1));
        },
    }
}
