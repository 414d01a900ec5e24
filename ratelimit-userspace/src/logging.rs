//! The agent's and CLI's log output on stderr: plain text for people and journald (no colours
//! unless stderr is a terminal, no timestamp when journald adds its own), or one JSON object per
//! line for log collectors (`--log-format json`, `[agent] log_format = "json"`).

use std::{io::IsTerminal as _, path::Path};

pub use crate::config::LogFormat;

/// The format to use: the command line's if given, else the `[agent] log_format` of the config
/// file the agent is about to load, else plain. The config file is only peeked at here: if it
/// cannot be read or parsed, plain text it is, and the agent reports the error itself.
#[must_use]
pub fn choose(flag: Option<LogFormat>, config: Option<&Path>) -> LogFormat {
    flag.or_else(|| config.and_then(from_config))
        .unwrap_or_default()
}

fn from_config(path: &Path) -> Option<LogFormat> {
    // Bounded and checked like every file the agent reads: a FIFO or a device named as the
    // config must not hang or exhaust the agent before it has even started logging.
    let (bytes, _) = crate::config::read_file_bounded(path, crate::config::MAX_FILE_BYTES).ok()?;
    let text = String::from_utf8(bytes).ok()?;
    let table: toml::Table = text.parse().ok()?;
    let value = table.get("agent")?.get("log_format")?.clone();
    value.try_into().ok()
}

/// Installs the global subscriber. `RUST_LOG` filters as usual (default `info`).
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder
            .json()
            .with_current_span(false)
            .with_span_list(false)
            .init(),
        LogFormat::Plain => {
            let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            let builder = builder.with_ansi(ansi);
            // systemd sets JOURNAL_STREAM when stderr goes to the journal, which stamps every
            // line itself: a second timestamp would only crowd `journalctl`.
            if std::env::var_os("JOURNAL_STREAM").is_some() {
                builder.without_time().init();
            } else {
                builder.init();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_wins_then_config_then_plain() {
        let dir = std::env::temp_dir().join(format!("rl-logfmt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("json.toml");
        std::fs::write(&json, "[agent]\nlog_format = \"json\"\n").unwrap();
        let broken = dir.join("broken.toml");
        std::fs::write(&broken, "[agent\n").unwrap();
        assert_eq!(choose(None, Some(&json)), LogFormat::Json);
        assert_eq!(
            choose(Some(LogFormat::Plain), Some(&json)),
            LogFormat::Plain
        );
        assert_eq!(choose(None, Some(&broken)), LogFormat::Plain);
        assert_eq!(
            choose(None, Some(&dir.join("missing.toml"))),
            LogFormat::Plain
        );
        assert_eq!(choose(Some(LogFormat::Json), None), LogFormat::Json);
        assert_eq!(choose(None, None), LogFormat::Plain);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A config path that names a FIFO (no writer) or a device is not waited on or read without
    /// end: plain text, at once (the agent then reports the file itself).
    #[test]
    fn a_fifo_or_a_device_as_config_is_not_read() {
        let dir = std::env::temp_dir().join(format!("rl-logfmt-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.toml");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let paths = [fifo, "/dev/zero".into()];
        std::thread::spawn(move || {
            for p in &paths {
                tx.send(choose(None, Some(p))).unwrap();
            }
        });
        for _ in 0..2 {
            let got = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("choosing the log format hung on a FIFO or a device");
            assert_eq!(got, LogFormat::Plain);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
