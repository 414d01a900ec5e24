//! The bpffs mount that holds the pin directory: mounted where it is missing, found in
//! `/proc/PID/mountinfo`, and a warning when it is private to the agent's mount namespace.

use std::{fs, path::Path};

use super::{DataplaneError, Result};

/// Makes sure bpffs is mounted at /sys/fs/bpf when the pin directory lives below it.
pub(super) fn ensure_bpffs(pin_dir: &Path) -> Result<()> {
    let root = Path::new("/sys/fs/bpf");
    if !pin_dir.starts_with(root) || is_bpffs(root) {
        return Ok(());
    }
    // Under `ip netns exec` (a private mount namespace with a fresh /sys) the bpffs mounted here
    // is private to this process tree: `warn_if_private_bpffs`, run next, says so.
    // Mode 0700: only root may create pins or directories in it (the kernel's default, 1777,
    // lets any user plant a directory where an agent will put its pins).
    let status = std::process::Command::new("mount")
        .args(["-t", "bpf", "-o", "mode=0700", "bpf"])
        .arg(root)
        .status()
        .map_err(|source| DataplaneError::Bpffs {
            path: root.into(),
            source,
        })?;
    if !status.success() || !is_bpffs(root) {
        return Err(DataplaneError::Bpffs {
            path: root.into(),
            source: std::io::Error::other(format!("mount -t bpf exited with {status}")),
        });
    }
    tracing::info!(path = %root.display(), "mounted bpffs");
    Ok(())
}

/// Warns when the bpffs that holds `pin_dir` is not the one PID 1 sees (a bpffs mounted in a
/// private mount namespace: `ip netns exec`, a container without the host's /sys/fs/bpf): the
/// pins end with that namespace, so enforcement does not outlive the agent as docs/design.md
/// says ("Containers and network namespaces").
pub(super) fn warn_if_private_bpffs(pin_dir: &Path) {
    let (Ok(ours), Ok(init)) = (
        fs::read_to_string("/proc/self/mountinfo"),
        fs::read_to_string("/proc/1/mountinfo"),
    ) else {
        return;
    };
    let Some((mount_point, dev)) = bpffs_of(&ours, pin_dir) else {
        return;
    };
    let shared = bpffs_devices(&init).any(|(_, d)| d == dev);
    if !shared {
        tracing::warn!(
            bpffs = %mount_point,
            "the bpffs holding the pins is private to this agent's mount namespace (PID 1 does not \
             see it): the pins, and enforcement after the agent exits or crashes, end with this \
             namespace. Run the agent in the host's mount namespace (`nsenter --net=/run/netns/NAME \
             ratelimit agent ...` rather than `ip netns exec`), or bind-mount the host's \
             /sys/fs/bpf into the container"
        );
    }
}

/// (mount point, device) of every bpffs in a `/proc/PID/mountinfo` text.
fn bpffs_devices(mountinfo: &str) -> impl Iterator<Item = (&str, &str)> {
    mountinfo.lines().filter_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let sep = f.iter().position(|x| *x == "-")?;
        if f.get(sep + 1) != Some(&"bpf") {
            return None;
        }
        Some((*f.get(4)?, *f.get(2)?))
    })
}

/// The bpffs mount (mount point, device) that `path` lives on: the longest mount point that
/// contains it.
pub(super) fn bpffs_of<'a>(mountinfo: &'a str, path: &Path) -> Option<(&'a str, &'a str)> {
    bpffs_devices(mountinfo)
        .filter(|(mnt, _)| path.starts_with(mnt))
        .max_by_key(|(mnt, _)| mnt.len())
}

fn is_bpffs(path: &Path) -> bool {
    fs::read_to_string("/proc/self/mountinfo")
        .is_ok_and(|m| bpffs_devices(&m).any(|(mnt, _)| Path::new(mnt) == path))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw
30 22 0:26 / /sys/fs/bpf rw,nosuid shared:12 - bpf bpf rw,mode=700
31 30 0:40 / /sys/fs/bpf/inner rw - bpf bpf rw
40 1 0:50 / /mnt/other rw - tmpfs tmpfs rw
";

    #[test]
    fn the_pins_bpffs_is_the_longest_bpf_mount_that_holds_them() {
        let all: Vec<_> = bpffs_devices(MOUNTINFO).collect();
        assert_eq!(
            all,
            [("/sys/fs/bpf", "0:26"), ("/sys/fs/bpf/inner", "0:40")]
        );
        let of = |p: &str| bpffs_of(MOUNTINFO, Path::new(p));
        assert_eq!(of("/sys/fs/bpf/ratelimit"), Some(("/sys/fs/bpf", "0:26")));
        assert_eq!(
            of("/sys/fs/bpf/inner/rl"),
            Some(("/sys/fs/bpf/inner", "0:40"))
        );
        assert_eq!(of("/mnt/other/rl"), None);
        // A path that only shares a prefix of characters is not under the mount.
        assert_eq!(of("/sys/fs/bpfx/rl"), None);
    }
}
