//! The interfaces of this process's network namespace: whether one exists, its index, and
//! ethtool commands on it (`SIOCETHTOOL`).

/// The index of interface `name` in this process's network namespace, 0 if there is none.
#[must_use]
pub fn ifindex(name: &str) -> u32 {
    if name.is_empty() || name.len() > 15 {
        return 0;
    }
    let Ok(c) = std::ffi::CString::new(name) else {
        return 0;
    };
    // SAFETY: a valid NUL-terminated string; if_nametoindex has no other precondition.
    unsafe { libc::if_nametoindex(c.as_ptr()) }
}

/// Whether generic receive offload is on for `iface` (`ETHTOOL_GGRO`), or `None` where the
/// kernel does not say. In skb (generic) mode the XDP program runs after GRO, on what it merged.
#[must_use]
pub fn gro_enabled(iface: &str) -> Option<bool> {
    /// `ETHTOOL_GGRO` of linux/ethtool.h.
    const ETHTOOL_GGRO: u32 = 0x2b;
    ethtool_value(iface, ETHTOOL_GGRO, 0).ok().map(|v| v != 0)
}

/// One `struct ethtool_value` command (`cmd`, e.g. `ETHTOOL_GGRO` or `ETHTOOL_SGRO` of
/// linux/ethtool.h, with `data`) on `iface` of this thread's network namespace, through
/// `SIOCETHTOOL`: the `data` the kernel gives back.
///
/// # Errors
/// A name that cannot be an interface's, or the socket's or the ioctl's error.
pub fn ethtool_value(iface: &str, cmd: u32, data: u32) -> std::io::Result<u32> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    /// `struct ethtool_value` of linux/ethtool.h.
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let name = iface.as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(&0) {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let mut value = EthtoolValue { cmd, data };
    // SAFETY: an all-zero ifreq is valid (a zero name, a null union).
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &src) in ifr.ifr_name.iter_mut().zip(name) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_data = (&raw mut value).cast();
    // SAFETY: plain socket creation; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: SIOCETHTOOL reads the NUL-terminated name and reads and writes `value`, which
    // outlives the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCETHTOOL, &raw mut ifr) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(value.data)
}

/// Whether `name` is an interface of this process's network namespace. (Not a look at
/// /sys/class/net: that shows the namespace of whoever mounted sysfs, which differs under
/// `nsenter --net` or in a container that was given the host's /sys.)
#[must_use]
pub fn interface_exists(name: &str) -> bool {
    ifindex(name) != 0
}
