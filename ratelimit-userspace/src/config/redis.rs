//! `[cluster]`'s Redis keys (`backend = "redis"`): the store's URLs, its ACL user and password
//! file, and the timeouts, each checked where it was written.

use std::path::{Path, PathBuf};

use super::{
    error::{ConfigError, Source},
    lists::{read_file_bounded, read_secret_file},
    model::{
        ClusterBackend, RedisConfig, DEFAULT_REDIS_COMMAND_TIMEOUT_MS,
        DEFAULT_REDIS_CONNECT_TIMEOUT_MS, MAX_REDIS_CA_FILE, MAX_REDIS_PASSWORD_FILE,
        MAX_REDIS_URLS, REDIS_TIMEOUT_MS,
    },
    raw::RawCluster,
};

const S: &str = "[cluster]";

/// The Redis store of a `[cluster]` table: `Some` under `backend = "redis"` (which needs
/// `redis`), `None` under gossip (which refuses the `redis*` keys rather than ignore them).
pub(super) fn redis_from_raw(
    src: &Source,
    raw: &RawCluster,
    backend: ClusterBackend,
) -> Result<Option<RedisConfig>, ConfigError> {
    if backend == ClusterBackend::Gossip {
        refuse_under_gossip(src, raw)?;
        return Ok(None);
    }
    let Some(urls) = &raw.redis else {
        let at = raw.backend.as_ref().map_or(0, |b| b.span().start);
        return Err(src.invalid(
            at,
            S,
            "redis",
            "missing: backend = \"redis\" needs the store's addresses (redis = [\"redis://HOST:PORT\"])",
        ));
    };
    let tls = check_urls(src, urls)?;
    let (user, password_file) = auth_from_raw(src, raw)?;
    let ca_file = ca_file_from_raw(src, raw, tls)?;
    Ok(Some(RedisConfig {
        urls: urls.get_ref().iter().map(|u| u.get_ref().clone()).collect(),
        user,
        password_file,
        ca_file,
        connect_timeout_ms: timeout_from_raw(
            src,
            &raw.redis_connect_timeout_ms,
            "redis_connect_timeout_ms",
            DEFAULT_REDIS_CONNECT_TIMEOUT_MS,
        )?,
        command_timeout_ms: timeout_from_raw(
            src,
            &raw.redis_command_timeout_ms,
            "redis_command_timeout_ms",
            DEFAULT_REDIS_COMMAND_TIMEOUT_MS,
        )?,
    }))
}

/// Under gossip, refuses the `redis*` keys rather than ignore them: the first set, in the order
/// listed here, is named.
fn refuse_under_gossip(src: &Source, raw: &RawCluster) -> Result<(), ConfigError> {
    let set = [
        ("redis", raw.redis.as_ref().map(|v| v.span().start)),
        (
            "redis_user",
            raw.redis_user.as_ref().map(|v| v.span().start),
        ),
        (
            "redis_password_file",
            raw.redis_password_file.as_ref().map(|v| v.span().start),
        ),
        (
            "redis_ca_file",
            raw.redis_ca_file.as_ref().map(|v| v.span().start),
        ),
        (
            "redis_connect_timeout_ms",
            raw.redis_connect_timeout_ms
                .as_ref()
                .map(|v| v.span().start),
        ),
        (
            "redis_command_timeout_ms",
            raw.redis_command_timeout_ms
                .as_ref()
                .map(|v| v.span().start),
        ),
    ];
    if let Some((key, Some(at))) = set.into_iter().find(|(_, at)| at.is_some()) {
        return Err(src.invalid(
            at,
            S,
            key,
            "is read only under backend = \"redis\" (set backend, or remove the key)",
        ));
    }
    Ok(())
}

/// Checks `redis`: 1 to [`MAX_REDIS_URLS`] valid URLs, all with TLS or all without. Returns
/// whether they use TLS (`rediss://`).
fn check_urls(
    src: &Source,
    urls: &toml::Spanned<Vec<toml::Spanned<String>>>,
) -> Result<bool, ConfigError> {
    if urls.get_ref().is_empty() || urls.get_ref().len() > MAX_REDIS_URLS {
        return Err(src.invalid(
            urls.span().start,
            S,
            "redis",
            format!(
                "must list 1 to {MAX_REDIS_URLS} URLs (got {})",
                urls.get_ref().len()
            ),
        ));
    }
    let mut tls = None;
    for u in urls.get_ref() {
        let is_tls =
            check_url(u.get_ref()).map_err(|m| src.invalid(u.span().start, S, "redis", m))?;
        if tls.is_some_and(|t| t != is_tls) {
            return Err(src.invalid(
                u.span().start,
                S,
                "redis",
                "mixes redis:// and rediss:// URLs: one store is reached with TLS or without",
            ));
        }
        tls = Some(is_tls);
    }
    Ok(tls == Some(true))
}

/// `redis_user` and `redis_password_file`, each optional: the user name checked, the password
/// file read and checked.
fn auth_from_raw(
    src: &Source,
    raw: &RawCluster,
) -> Result<(Option<String>, Option<PathBuf>), ConfigError> {
    let user = match &raw.redis_user {
        None => None,
        Some(u) => {
            check_user(u.get_ref()).map_err(|m| src.invalid(u.span().start, S, "redis_user", m))?;
            Some(u.get_ref().clone())
        }
    };
    let password_file = match &raw.redis_password_file {
        None => None,
        Some(p) => {
            read_password(p.get_ref())
                .map_err(|m| src.invalid(p.span().start, S, "redis_password_file", m))?;
            Some(p.get_ref().clone())
        }
    };
    Ok((user, password_file))
}

/// `redis_ca_file`, optional: refused unless the URLs use TLS (`tls`), else read and checked.
fn ca_file_from_raw(
    src: &Source,
    raw: &RawCluster,
    tls: bool,
) -> Result<Option<PathBuf>, ConfigError> {
    match &raw.redis_ca_file {
        None => Ok(None),
        Some(p) if !tls => Err(src.invalid(
            p.span().start,
            S,
            "redis_ca_file",
            "is read only with rediss:// URLs (TLS): the store is reached without TLS",
        )),
        Some(p) => {
            read_ca(p.get_ref()).map_err(|m| src.invalid(p.span().start, S, "redis_ca_file", m))?;
            Ok(Some(p.get_ref().clone()))
        }
    }
}

/// A timeout in milliseconds, `key` of `[cluster]`: `default` when not written, else within
/// [`REDIS_TIMEOUT_MS`].
fn timeout_from_raw(
    src: &Source,
    v: &Option<toml::Spanned<i64>>,
    key: &str,
    default: u64,
) -> Result<u64, ConfigError> {
    match v {
        None => Ok(default),
        Some(v) => {
            let n = *v.get_ref();
            match u64::try_from(n) {
                Ok(n) if REDIS_TIMEOUT_MS.contains(&n) => Ok(n),
                _ => Err(src.invalid(
                    v.span().start,
                    S,
                    key,
                    format!(
                        "must be between {} and {} milliseconds (got {n})",
                        REDIS_TIMEOUT_MS.start(),
                        REDIS_TIMEOUT_MS.end()
                    ),
                )),
            }
        }
    }
}

/// Checks a store URL, `redis://HOST[:PORT][/DB]` or `rediss://...` (TLS): `Ok(true)` for TLS.
/// HOST is an IPv4 address, a bracketed IPv6 address or a DNS name; PORT 1-65535 (default
/// 6379); DB a database number (a Redis Cluster has only 0). Credentials in the URL are
/// refused (they would show wherever the config does): `redis_user` and `redis_password_file`
/// carry them.
pub fn check_url(url: &str) -> Result<bool, String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("redis://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("rediss://") {
        (true, r)
    } else {
        return Err(format!(
            "{url:?} is not a redis:// or rediss:// URL (e.g. \"redis://198.51.100.7:6379\")"
        ));
    };
    if rest.contains('@') {
        return Err(format!(
            "{url:?} holds credentials: put the user in redis_user and the password in \
             redis_password_file"
        ));
    }
    if rest.contains(['?', '#']) || rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "{url:?}: only redis[s]://HOST[:PORT][/DB] is accepted (no query, fragment or spaces)"
        ));
    }
    let (authority, db) = rest.split_once('/').unwrap_or((rest, ""));
    if !db.is_empty() && (db.len() > 5 || !db.bytes().all(|b| b.is_ascii_digit())) {
        return Err(format!(
            "{url:?}: the database after '/' must be a number (got {db:?})"
        ));
    }
    let (host, port) =
        if let Some(v6) = authority.strip_prefix('[') {
            let (addr, after) = v6
                .split_once(']')
                .ok_or_else(|| format!("{url:?}: an IPv6 address ends with ']'"))?;
            addr.parse::<std::net::Ipv6Addr>()
                .map_err(|_| format!("{url:?}: {addr:?} is not an IPv6 address"))?;
            match after {
                "" => (addr, None),
                p => (
                    addr,
                    Some(p.strip_prefix(':').ok_or_else(|| {
                        format!("{url:?}: expected ':PORT' after the IPv6 address")
                    })?),
                ),
            }
        } else {
            match authority.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
    if host.is_empty() {
        return Err(format!("{url:?} names no host"));
    }
    if !authority.starts_with('[')
        && (host.len() > 253
            || !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_')))
    {
        return Err(format!(
            "{url:?}: {host:?} is neither an IP address nor a host name"
        ));
    }
    if let Some(p) = port {
        match p.parse::<u16>() {
            Ok(n) if n > 0 => {}
            _ => return Err(format!("{url:?}: the port must be 1 to 65535 (got {p:?})")),
        }
    }
    Ok(tls)
}

/// Checks an ACL user name: 1 to 128 bytes, no space or control character.
fn check_user(user: &str) -> Result<(), String> {
    if user.is_empty() || user.len() > 128 {
        return Err(format!("must be 1 to 128 bytes (got {})", user.len()));
    }
    if user.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{user:?} holds a space or a control character"));
    }
    Ok(())
}

/// Reads and checks a `redis_ca_file`: regular, at most [`MAX_REDIS_CA_FILE`] bytes, owned by
/// root or the agent's user and writable by no one else (whoever can change it chooses which
/// store the agent trusts), PEM text with a certificate. Returns its bytes.
pub fn read_ca(path: &Path) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let shown = path.display();
    if path.as_os_str().is_empty() {
        return Err("must not be empty".into());
    }
    let (bytes, meta) =
        read_file_bounded(path, MAX_REDIS_CA_FILE).map_err(|e| format!("{shown}: {e}"))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != euid {
        return Err(format!(
            "{shown}: owned by uid {}, neither root nor the agent's user (uid {euid}): that user \
             could make the agent trust any store; run `chown root` on it",
            meta.uid()
        ));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o022 != 0 {
        return Err(format!(
            "{shown}: mode {mode:o} lets other users change the certificates the store is \
             trusted by; run `chmod 644` on it"
        ));
    }
    let text = std::str::from_utf8(&bytes).map_err(|_| format!("{shown}: not PEM text"))?;
    if !text.contains("-----BEGIN CERTIFICATE-----") {
        return Err(format!(
            "{shown}: holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        ));
    }
    Ok(bytes)
}

/// Reads and checks the password file as the cluster key file is checked (regular, at most
/// [`MAX_REDIS_PASSWORD_FILE`] bytes, owned by root or the agent's user, not readable by
/// others), and returns the password: its text without the trailing newline, not empty, one
/// line of UTF-8.
pub fn read_password(path: &Path) -> Result<String, String> {
    let shown = path.display();
    if path.as_os_str().is_empty() {
        return Err("must not be empty".into());
    }
    let (bytes, _) = read_secret_file(path, MAX_REDIS_PASSWORD_FILE, "Redis password file")
        .map_err(|e| format!("{shown}: {e}"))?;
    let mut text =
        String::from_utf8(bytes).map_err(|_| format!("{shown}: the password is not UTF-8 text"))?;
    while text.ends_with(['\n', '\r']) {
        text.pop();
    }
    if text.is_empty() {
        return Err(format!("{shown}: holds no password"));
    }
    if text.contains(['\n', '\r']) {
        return Err(format!("{shown}: the password is one line"));
    }
    Ok(text)
}
