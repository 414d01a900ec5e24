//! The files a config names, and rule sources: reading the config text, resolving paths relative
//! to it, inline CIDRs (`source`) and list files (`source_file`, one CIDR per line), each prefix
//! remembered with where it was written so that an error can point at it.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use ipnet::IpNet;
use toml::Spanned;

use super::{
    error::{ConfigError, Source},
    model::MAX_RULE_PREFIXES,
    validate::{parse_source, validate_source},
};

/// Where a rule's source prefixes were written, parallel to [`RuleConfig::sources`], so that
/// errors about one prefix can point at it.
pub(super) enum SourcesFrom {
    /// `source`: byte offsets of the key's value and of each prefix in the config text.
    Inline { key_offset: usize, at: Vec<usize> },
    /// `source_file`: offset of the key's value in the config text; the list file and the line
    /// of each prefix in it.
    List {
        key_offset: usize,
        path: PathBuf,
        lines: Vec<usize>,
    },
}

impl SourcesFrom {
    pub(super) fn key(&self) -> &'static str {
        match self {
            SourcesFrom::Inline { .. } => "source",
            SourcesFrom::List { .. } => "source_file",
        }
    }

    pub(super) fn key_offset(&self) -> usize {
        match self {
            SourcesFrom::Inline { key_offset, .. } | SourcesFrom::List { key_offset, .. } => {
                *key_offset
            }
        }
    }

    /// An error about the rule's `index`th prefix.
    pub(super) fn error_at(
        &self,
        src: &Source,
        section: &str,
        rule: &str,
        index: usize,
        message: String,
    ) -> ConfigError {
        match self {
            SourcesFrom::Inline { at, .. } => src.invalid(at[index], section, "source", message),
            SourcesFrom::List {
                key_offset,
                path,
                lines,
            } => ConfigError::List {
                path: path.clone(),
                list_line: lines[index],
                message,
                rule: rule.to_owned(),
                origin: src.origin.to_owned(),
                line: src.line(*key_offset),
            },
        }
    }
}

/// Reads a `source_file`: one CIDR (or address) per line, `#` comments, blank lines ignored.
/// Returns the distinct prefixes in file order with their 1-based lines, or the line and the
/// message of the first bad entry.
pub(super) fn read_list(path: &Path) -> Result<(Vec<IpNet>, Vec<usize>), ListError> {
    if std::fs::metadata(path).map_err(ListError::Io)?.is_dir() {
        return Err(ListError::Io(std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            "is a directory, expected a file with one CIDR per line",
        )));
    }
    let bytes = read_bounded(path).map_err(ListError::Io)?;
    parse_list(&bytes).map_err(|(line, message)| ListError::At(line, message))
}

/// Parses the contents of a `source_file` list: one CIDR (or address) per line, `#` comments,
/// blank lines ignored. Returns the distinct prefixes in order with their 1-based lines, or the
/// line and the message of the first bad entry.
pub fn parse_list(bytes: &[u8]) -> Result<(Vec<IpNet>, Vec<usize>), (usize, String)> {
    let mut seen = HashSet::new();
    let (mut nets, mut lines) = (Vec::new(), Vec::new());
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let content = match line.iter().position(|&b| b == b'#') {
            Some(end) => &line[..end],
            None => line,
        };
        let text = std::str::from_utf8(content)
            .map_err(|_| (i + 1, "not valid UTF-8 text".to_owned()))?
            .trim();
        if text.is_empty() {
            continue;
        }
        let net = parse_source(text).map_err(|_| (i + 1, format!("invalid CIDR {text:?}")))?;
        validate_source(&net).map_err(|m| (i + 1, m))?;
        if seen.insert(net) {
            if nets.len() == MAX_RULE_PREFIXES {
                return Err((
                    i + 1,
                    format!(
                        "more than {MAX_RULE_PREFIXES} prefixes: one rule may list at most \
                         {MAX_RULE_PREFIXES}"
                    ),
                ));
            }
            nets.push(net);
            lines.push(i + 1);
        }
    }
    Ok((nets, lines))
}

pub(super) enum ListError {
    Io(std::io::Error),
    At(usize, String),
}

/// The prefixes of a `source_file`, without duplicates.
pub(super) fn list_sources(
    src: &Source,
    section: &str,
    rule: &str,
    file: Spanned<PathBuf>,
) -> Result<(Vec<IpNet>, SourcesFrom), ConfigError> {
    let key_offset = file.span().start;
    if file.get_ref().as_os_str().is_empty() {
        return Err(src.invalid(key_offset, section, "source_file", "must not be empty"));
    }
    let path = resolve(src.base, file.get_ref());
    let (nets, lines) = read_list(&path).map_err(|e| match e {
        ListError::Io(source) => ConfigError::ListRead {
            path: path.clone(),
            rule: rule.to_owned(),
            origin: src.origin.to_owned(),
            line: src.line(key_offset),
            source,
        },
        ListError::At(list_line, message) => ConfigError::List {
            path: path.clone(),
            list_line,
            message,
            rule: rule.to_owned(),
            origin: src.origin.to_owned(),
            line: src.line(key_offset),
        },
    })?;
    Ok((
        nets,
        SourcesFrom::List {
            key_offset,
            path,
            lines,
        },
    ))
}

/// The text of the config file at `path`.
pub(super) fn read_text(path: &Path) -> Result<String, ConfigError> {
    // Checked first because reading a directory fails with a less helpful EISDIR.
    if path.is_dir() {
        return Err(ConfigError::IsDirectory {
            path: path.to_owned(),
        });
    }
    let bytes = read_bounded(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        ConfigError::NotUtf8 {
            line: valid.iter().filter(|&&b| b == b'\n').count() + 1,
            origin: path.display().to_string(),
        }
    })
}

/// Largest config or list file the agent reads.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Reads the file at `path` whole, if it is a regular file of at most [`MAX_FILE_BYTES`]: a FIFO,
/// a device (`/dev/zero`), a socket or an oversized file is refused at once instead of hanging
/// or exhausting the agent. Opened non-blocking (a FIFO without a writer would block the open),
/// checked on the open descriptor (so the file cannot be swapped between check and read), and
/// read no further than the limit even if it grows meanwhile.
pub(super) fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    read_file_bounded(path, MAX_FILE_BYTES).map(|(bytes, _)| bytes)
}

/// [`read_bounded`] with a limit of `max` bytes, for any file the agent reads (the cluster key,
/// the config file peeked at for the log format): returns the bytes and the metadata of the
/// descriptor they were read from (so owner and mode checks are of the very file read).
pub fn read_file_bounded(path: &Path, max: u64) -> std::io::Result<(Vec<u8>, std::fs::Metadata)> {
    use std::{
        io::Read as _,
        os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _},
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_dir() {
            "a directory"
        } else {
            "something other than a file"
        };
        return Err(std::io::Error::other(format!(
            "is {what}, not a regular file: refused"
        )));
    }
    let too_big = || {
        let limit = if max >= 1 << 20 {
            format!("{} MiB", max >> 20)
        } else {
            format!("{max} bytes")
        };
        std::io::Error::other(format!("larger than {limit}: refused"))
    };
    if meta.len() > max {
        return Err(too_big());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(too_big());
    }
    Ok((bytes, meta))
}

/// Why a secret file (`[cluster] key_file`, `redis_password_file`) cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    /// The file cannot be read (missing, a FIFO, a device, too large...).
    #[error("{0}")]
    Read(String),
    /// Its permission bits let other users read or change it.
    #[error("mode {0:o} lets other users read or change the secret; run `chmod 600` on it")]
    Permissions(u32),
    /// It is owned by a user other than root or the agent's (`uid`, `euid`).
    #[error("owned by uid {0}, neither root nor the agent's user (uid {1}): that user could change the secret; run `chown root` on it")]
    Owner(u32, u32),
}

/// Reads a secret file, at most `max` bytes, as [`read_file_bounded`] does, and checks it as ssh
/// checks a private key: owned by root or the agent's own user, neither readable nor writable
/// by other users (group access is allowed with a warning naming `what`). Shared by the cluster
/// key file and the Redis password file.
pub fn read_secret_file(
    path: &Path,
    max: u64,
    what: &str,
) -> Result<(Vec<u8>, std::fs::Metadata), SecretFileError> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let (bytes, meta) =
        read_file_bounded(path, max).map_err(|e| SecretFileError::Read(e.to_string()))?;
    let owner = meta.uid();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if owner != 0 && owner != euid {
        return Err(SecretFileError::Owner(owner, euid));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o007 != 0 {
        return Err(SecretFileError::Permissions(mode));
    }
    if mode & 0o070 != 0 {
        tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "the {what} is accessible to its group; chmod 600 is safer");
    }
    Ok((bytes, meta))
}

/// The directory relative paths in the config file at `path` are resolved against.
pub(super) fn base_dir(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new(""))
}

/// `path` as named in a config file in directory `base`.
pub(super) fn resolve(base: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_owned()
    } else {
        base.join(path)
    }
}
