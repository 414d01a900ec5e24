//! The cluster's pre-shared key: read from `[cluster] key_file`, checked, and turned into the
//! AEAD key that authenticates every gossip datagram.
//!
//! The file holds at least 32 bytes of secret (any bytes; a trailing newline is ignored, so
//! `head -c 32 /dev/urandom | base64 > cluster.key` works). It must not be readable or writable
//! by other users, and must be owned by root or the agent's own user: the agent refuses to start
//! otherwise, as ssh does with a private key, because a leaked or planted key lets anyone charge
//! every host's buckets. Group access is allowed with a warning. It is read like every file the
//! agent reads: opened non-blocking and checked on the descriptor (a FIFO or a device is refused),
//! at most 64 KiB.

use std::path::Path;

use crate::config::SecretFileError;

use hkdf::Hkdf;
use sha2::Sha256;

/// Fewest bytes of secret the key file must hold.
pub const MIN_KEY_LEN: usize = 32;
/// Largest key file read (a key file is a secret, not a document).
const MAX_KEY_FILE: u64 = 64 * 1024;
/// HKDF salt: versions the derivation, so a future wire format can derive a different key.
const SALT: &[u8] = b"ratelimit cluster gossip v1";

/// Why the key file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file cannot be read.
    #[error("[cluster] key_file {path}: {reason}")]
    Read {
        /// The key file.
        path: String,
        /// What failed.
        reason: String,
    },
    /// The file's permissions let other users read or change it.
    #[error("[cluster] key_file {path}: mode {mode:o} lets other users read or change the cluster key; run `chmod 600 {path}`")]
    Permissions {
        /// The key file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// The file is owned by another user than root or the agent's: that user can change the
    /// cluster key (or swap the file).
    #[error("[cluster] key_file {path}: owned by uid {uid}, neither root nor the agent's user (uid {euid}): that user could change the cluster key; run `chown root {path}`")]
    Owner {
        /// The key file.
        path: String,
        /// Its owner.
        uid: u32,
        /// The agent's effective user.
        euid: u32,
    },
    /// The file holds too little secret.
    #[error("[cluster] key_file {path}: holds {len} bytes, at least {MIN_KEY_LEN} are needed (e.g. `head -c 32 /dev/urandom | base64 > {path}`)")]
    TooShort {
        /// The key file.
        path: String,
        /// Bytes of secret found (trailing newline excluded).
        len: usize,
    },
}

/// The derived 256-bit AEAD key, bound to the cluster id.
#[derive(Clone)]
pub struct ClusterKey {
    key: [u8; 32],
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    /// Reads and checks `path` and derives the key for `cluster_id`.
    pub fn load(path: &Path, cluster_id: &str) -> Result<Self, KeyError> {
        let shown = path.display().to_string();
        let read_err = |reason: String| KeyError::Read {
            path: shown.clone(),
            reason,
        };
        // Opened non-blocking and checked on the descriptor read (a FIFO or a device swapped in
        // is refused at once, not waited on or read without end), at most MAX_KEY_FILE bytes;
        // owner and mode as `redis_password_file`'s (the same checks).
        let (bytes, _) = crate::config::read_secret_file(path, MAX_KEY_FILE, "cluster key file")
            .map_err(|e| match e {
                SecretFileError::Read(reason) => read_err(reason),
                SecretFileError::Owner(uid, euid) => KeyError::Owner {
                    path: shown.clone(),
                    uid,
                    euid,
                },
                SecretFileError::Permissions(mode) => KeyError::Permissions {
                    path: shown.clone(),
                    mode,
                },
            })?;
        Self::from_secret(&bytes, cluster_id).map_err(|len| KeyError::TooShort { path: shown, len })
    }

    /// Derives the key from the key file's contents; `Err(len)` when the secret is too short.
    pub fn from_secret(contents: &[u8], cluster_id: &str) -> Result<Self, usize> {
        let mut secret = contents;
        while let [rest @ .., b'\n' | b'\r'] = secret {
            secret = rest;
        }
        if secret.len() < MIN_KEY_LEN {
            return Err(secret.len());
        }
        // HKDF-SHA256 with the cluster id as `info`: two clusters sharing a key file still get
        // different keys, so a datagram of one is rejected by the other.
        let hk = Hkdf::<Sha256>::new(Some(SALT), secret);
        let mut key = [0u8; 32];
        hk.expand(cluster_id.as_bytes(), &mut key)
            .expect("32 bytes is a valid HKDF-SHA256 length");
        Ok(Self { key })
    }

    /// The raw key bytes (for the cipher).
    #[must_use]
    pub fn bytes(&self) -> &[u8; 32] {
        &self.key
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn trailing_newline_is_not_secret_and_cluster_id_binds() {
        let a = ClusterKey::from_secret(&[b'k'; 32], "one").unwrap();
        let b = ClusterKey::from_secret(&[&[b'k'; 32][..], b"\n"].concat(), "one").unwrap();
        let c = ClusterKey::from_secret(&[b'k'; 32], "two").unwrap();
        assert_eq!(a.bytes(), b.bytes());
        assert_ne!(a.bytes(), c.bytes());
        assert_eq!(
            ClusterKey::from_secret(&[&[b'k'; 31][..], b"\n"].concat(), "one").unwrap_err(),
            31
        );
    }

    #[test]
    fn file_checks() {
        let dir = std::env::temp_dir().join(format!("rl-key-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("k");
        std::fs::write(&path, [b'x'; 40]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = ClusterKey::load(&path, "c").unwrap_err();
        assert!(
            matches!(e, KeyError::Permissions { mode: 0o644, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        ClusterKey::load(&path, "c").unwrap();
        std::fs::write(&path, b"short\n").unwrap();
        assert!(matches!(
            ClusterKey::load(&path, "c").unwrap_err(),
            KeyError::TooShort { len: 5, .. }
        ));
        let missing = ClusterKey::load(&dir.join("missing"), "c").unwrap_err();
        assert!(missing.to_string().contains("missing"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A key file owned by another user is refused, naming the path and the owner; a FIFO, a
    /// device or an oversized file is refused at once (never waited on or read without end).
    #[test]
    fn owner_and_file_kind_checks() {
        use std::os::unix::fs::OpenOptionsExt as _;
        let dir = std::env::temp_dir().join(format!("rl-key-owner-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("k");
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .unwrap();
        std::fs::write(&path, [b'x'; 40]).unwrap();
        ClusterKey::load(&path, "c").unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
            let e = ClusterKey::load(&path, "c").unwrap_err();
            assert!(matches!(e, KeyError::Owner { uid: 65534, .. }), "{e}");
            let text = e.to_string();
            assert!(
                text.contains(&path.display().to_string()) && text.contains("uid 65534"),
                "{text}"
            );
        } else {
            println!("not root: the owner check is only tested as root");
        }

        // A FIFO without a writer: refused at once (a blocking open or read would hang).
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = ClusterKey::load(&fifo, "c").unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        // A device that never ends.
        let e = ClusterKey::load(Path::new("/dev/zero"), "c").unwrap_err();
        assert!(e.to_string().contains("device"), "{e}");
        // Larger than a key file.
        let big = dir.join("big");
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&big)
            .unwrap()
            .set_len(MAX_KEY_FILE + 1)
            .unwrap();
        let e = ClusterKey::load(&big, "c").unwrap_err();
        assert!(e.to_string().contains("larger than"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
