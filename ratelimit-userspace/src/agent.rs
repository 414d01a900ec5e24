//! The agent: validates the config, loads the XDP program, installs the rules, attaches to the
//! interfaces, and on shutdown detaches cleanly.
//!
//! Everything that can be refused (config syntax, rule semantics, unknown interfaces) is checked
//! before the program is loaded, so a bad config changes nothing on the host.

use std::{future::Future, path::PathBuf};

use aya_log::EbpfLogger;
use ratelimit_common::config_flags;
use tokio::io::unix::AsyncFd;

use crate::{
    compile::{compile, CompileError, RuleIds},
    config::{AttachMode, Config, ConfigError},
    dataplane::{Dataplane, DataplaneError, LoadOptions},
    maps::MapsError,
};

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The config file is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The rules do not compile.
    #[error("{path}: {source}")]
    Compile {
        /// Config file.
        path: PathBuf,
        /// What is wrong.
        source: CompileError,
    },
    /// No interface to attach to.
    #[error("no interfaces to attach to: set `interfaces` in the [agent] table of {0} or pass --iface")]
    NoInterfaces(PathBuf),
    /// An interface named in the config or on the command line does not exist.
    #[error("interface {name:?} (from {origin}) does not exist")]
    NoSuchInterface {
        /// Interface name.
        name: String,
        /// Where it was named.
        origin: String,
    },
    /// Loading, attaching or updating the data plane failed.
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    /// Reading the pinned maps failed.
    #[error(transparent)]
    Maps(#[from] MapsError),
    /// Setting up signal handling or the log reader failed.
    #[error("{0}")]
    Runtime(String),
}

/// What the agent is asked to do (the config file plus command-line overrides).
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// Config file.
    pub config_path: PathBuf,
    /// Interfaces from the command line; replace the config's when not empty.
    pub interfaces: Vec<String>,
    /// Attach mode from the command line; overrides the config's.
    pub mode: Option<AttachMode>,
}

/// Loads and validates the config with the command-line overrides applied; nothing on the host is
/// touched. Returns the config with the final interface list.
pub fn prepare(opts: &AgentOptions) -> Result<Config, AgentError> {
    let mut config = Config::load(&opts.config_path)?;
    let origin = if opts.interfaces.is_empty() {
        config_origin(&opts.config_path)
    } else {
        config.agent.interfaces.clone_from(&opts.interfaces);
        "--iface".to_string()
    };
    if let Some(mode) = opts.mode {
        config.agent.mode = mode;
    }
    if config.agent.interfaces.is_empty() {
        return Err(AgentError::NoInterfaces(opts.config_path.clone()));
    }
    for name in &config.agent.interfaces {
        if name.is_empty() || name.contains('/') || !std::path::Path::new("/sys/class/net").join(name).exists() {
            return Err(AgentError::NoSuchInterface { name: name.clone(), origin: origin.clone() });
        }
    }
    // Compile once against empty ids: proves the rule set is valid before anything is loaded.
    compile(&config.rules, &RuleIds::new())
        .map_err(|source| AgentError::Compile { path: opts.config_path.clone(), source })?;
    Ok(config)
}

fn config_origin(path: &std::path::Path) -> String {
    format!("[agent] interfaces in {}", path.display())
}

/// Runs the agent until `shutdown` completes, then detaches and removes the pinned maps.
pub async fn run(opts: AgentOptions, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
    let config = prepare(&opts)?;
    let mut dp = Dataplane::load(&LoadOptions {
        pin_dir: config.agent.pin_path.clone(),
        max_buckets: config.agent.max_buckets,
    })?;
    match start(&opts, &config, &mut dp) {
        Ok(()) => {}
        Err(e) => {
            // Leave nothing half-done behind: no attachment, no pins.
            if let Err(cleanup) = dp.remove() {
                tracing::warn!(error = %cleanup, "cleaning up after a failed start");
            }
            return Err(e);
        }
    }
    let log_task = if config.agent.ebpf_log { Some(spawn_ebpf_log_reader(&mut dp)?) } else { None };
    tracing::info!("running; SIGINT or SIGTERM detaches and exits");
    shutdown.await;
    if let Some(task) = log_task {
        task.abort();
    }
    tracing::info!("shutting down: detaching");
    dp.remove()?;
    tracing::info!("detached and removed pinned maps");
    Ok(())
}

fn start(opts: &AgentOptions, config: &Config, dp: &mut Dataplane) -> Result<(), AgentError> {
    // Ids of rules already installed (a previous agent's pinned state) are kept, so unchanged
    // rules keep their buckets.
    let installed = dp.maps().named_rules()?;
    let mut ids = RuleIds::from_installed(installed.into_iter().map(|(id, (name, _, rule))| (name, id, rule)))
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "pinned rule ids unusable; assigning new ones");
            RuleIds::new()
        });
    let set = compile(&config.rules, &ids)
        .map_err(|source| AgentError::Compile { path: opts.config_path.clone(), source })?;
    dp.install(&set)?;
    ids.commit(&set).map_err(|source| AgentError::Compile { path: opts.config_path.clone(), source })?;
    let mut flags = 0;
    if config.agent.dry_run {
        flags |= config_flags::DRY_RUN;
    }
    if config.agent.ebpf_log {
        flags |= config_flags::DEBUG_LOG;
    }
    dp.set_flags(flags)?;
    tracing::info!(
        rules = set.rules.len(),
        prefixes = set.prefixes.len(),
        dry_run = config.agent.dry_run,
        pin_dir = %config.agent.pin_path.display(),
        "rules installed"
    );
    for iface in &config.agent.interfaces {
        let att = dp.attach(iface, config.agent.mode)?;
        tracing::info!(iface = %att.iface, mode = att.mode, "attached");
    }
    Ok(())
}

/// Forwards the program's aya-log records to the agent's log (only emitted when `ebpf_log` is on).
fn spawn_ebpf_log_reader(dp: &mut Dataplane) -> Result<tokio::task::JoinHandle<()>, AgentError> {
    let logger = EbpfLogger::init(dp.ebpf_mut())
        .map_err(|e| AgentError::Runtime(format!("starting the eBPF log reader: {e}")))?;
    // SAFETY: the logger owns the ring buffer's fd and moves into the AsyncFd, so the fd stays
    // open for as long as it is registered.
    let mut fd = unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) }
        .map_err(|e| AgentError::Runtime(format!("polling the eBPF log ring buffer: {e}")))?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok(mut guard) = fd.readable_mut().await else { return };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() -> Result<(), AgentError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).map_err(|e| AgentError::Runtime(format!("SIGINT handler: {e}")))?;
    let mut term = signal(SignalKind::terminate()).map_err(|e| AgentError::Runtime(format!("SIGTERM handler: {e}")))?;
    tokio::select! {
        _ = int.recv() => tracing::info!("SIGINT"),
        _ = term.recv() => tracing::info!("SIGTERM"),
    }
    Ok(())
}
