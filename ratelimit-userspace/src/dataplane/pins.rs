//! The pin directory: made the agent's own (this user's, mode 0700) and locked before anything in
//! it is used, walking from the bpffs mount with `*at` system calls on verified descriptors so no
//! symlink is followed and nothing another user planted is used (it is moved aside); and the
//! removal of pinned links and maps.

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::{bpffs::bpffs_of, DataplaneError, Result};
use crate::maps;

/// How many times [`own_dir`] looks at a name again after moving aside what it found there. One
/// look normally settles it: what [`quarantine`] swaps in is a fresh directory of the agent's own,
/// which no other user can move in a sticky parent (a bpffs root always is).
const PIN_DIR_TRIES: u32 = 64;

/// Makes `dir` the agent's own pin directory and locks it: a directory owned by this agent's
/// user, mode 0700, so that no other user can open it, take its lock or touch the pins in it.
/// Anything else found at its path, or at a path of a directory below the bpffs mount that leads
/// to it (anyone may create entries in a bpffs mounted with the kernel's default mode 1777: a
/// symlink, a directory of another user, a directory holding entries that are not this user's
/// pins, one locked by a process of another user or while others could open it), is neither
/// followed nor used nor obeyed: it is moved aside to a `NAME_quarantine_PID_RANDOM` name in the
/// same parent, with a warning, and a fresh directory takes its place in the same rename (no
/// window for anyone to plant another).
/// Nothing is opened by path below the bpffs mount: each step is relative to a verified
/// descriptor of its parent, and no symlink is followed. A directory of this user, mode 0700,
/// is kept with its pins (an earlier agent's, to adopt). Returns whether the directory is new,
/// and the descriptor that holds the lock.
///
/// The lock is an exclusive `flock`, so that one agent at a time uses the directory: a second
/// agent started with the same `pin_path` (but another socket) would otherwise adopt the first's
/// maps and links, replace its rules, and unpin everything when it exits. The kernel drops the
/// lock when the holder exits, crash included, so a stale lock cannot block a restart.
pub(super) fn prepare_pin_dir(dir: &Path) -> Result<(bool, fs::File)> {
    use std::os::unix::fs::MetadataExt as _;
    let io_err = io_err_at(dir);
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let (mut parent, mut parent_path, names) =
        walk_start(dir).map_err(|e| io_err("opening the parent of pin directory", e))?;
    let Some((last, middle)) = names.split_last() else {
        return Err(io_err(
            "using pin directory",
            std::io::Error::other("it is the bpffs mount itself: name a directory below it"),
        ));
    };
    for name in middle {
        parent_path.push(name);
        parent = own_dir(&parent, name, &parent_path, euid, false)?.1;
    }
    let (fresh, file) = own_dir(&parent, last, dir, euid, true)?;
    // What the path names is what was verified and locked (the agent pins by path).
    let by_path = fs::symlink_metadata(dir).map_err(|e| io_err("inspecting pin directory", e))?;
    let held = file
        .metadata()
        .map_err(|e| io_err("inspecting pin directory", e))?;
    if (by_path.dev(), by_path.ino()) != (held.dev(), held.ino()) {
        return Err(io_err(
            "using pin directory",
            std::io::Error::other("its path names another directory than the one verified"),
        ));
    }
    Ok((fresh, file))
}

/// The directory to start the walk to `dir` from (opened), its path, and the names below it:
/// the bpffs mount that holds `dir` (root's), or else `dir`'s parent (created if missing).
fn walk_start(dir: &Path) -> std::io::Result<(fs::File, PathBuf, Vec<std::ffi::OsString>)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::path::Component;
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let (start, rest) = match bpffs_of(&mountinfo, dir) {
        Some((mnt, _)) => (PathBuf::from(mnt), dir.strip_prefix(mnt).unwrap_or(dir)),
        None => {
            let parent = dir.parent().unwrap_or(Path::new("/"));
            fs::create_dir_all(parent)?;
            (
                parent.to_path_buf(),
                Path::new(dir.file_name().unwrap_or_default()),
            )
        }
    };
    let mut names = Vec::new();
    for c in rest.components() {
        match c {
            Component::Normal(name) => names.push(name.to_owned()),
            Component::CurDir => {}
            _ => {
                return Err(std::io::Error::other(format!(
                    "{} is not a plain path below {}",
                    dir.display(),
                    start.display()
                )))
            }
        }
    }
    let file = fs::File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(&start)?;
    Ok((file, start, names))
}

fn c_name(name: &std::ffi::OsStr) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt as _;
    std::ffi::CString::new(name.as_bytes()).map_err(std::io::Error::other)
}

fn last_os_error_unless(ret: libc::c_int) -> std::io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `fstatat(parent, name, AT_SYMLINK_NOFOLLOW)`.
fn stat_at(parent: &fs::File, name: &std::ffi::CStr) -> std::io::Result<libc::stat> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: all-zero is a valid `stat`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a descriptor we own, a NUL-terminated name and a `stat` to write.
    last_os_error_unless(unsafe {
        libc::fstatat(
            parent.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    Ok(st)
}

fn mkdir_at(parent: &fs::File, name: &std::ffi::CStr) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: a descriptor we own and a NUL-terminated name.
    last_os_error_unless(unsafe { libc::mkdirat(parent.as_raw_fd(), name.as_ptr(), 0o700) })
}

fn rename_at(
    parent: &fs::File,
    from: &std::ffi::CStr,
    to: &std::ffi::CStr,
    flags: libc::c_uint,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let fd = parent.as_raw_fd();
    // SAFETY: a descriptor we own and NUL-terminated names.
    last_os_error_unless(unsafe { libc::renameat2(fd, from.as_ptr(), fd, to.as_ptr(), flags) })
}

/// What a file's type is called in a log.
fn kind_of(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symlink",
        libc::S_IFREG => "file",
        _ => "special file",
    }
}

/// Makes `name` in `parent` (whose path is `path`) a directory of user `euid`, opened without
/// following a symlink; `last`: the pin directory itself (mode 0700, locked, holding nothing but
/// files of `euid`), else a directory on the way to it (not writable by others). What is there
/// otherwise is moved aside (see [`quarantine`]). Returns whether the directory is new.
// One retry loop: each `continue` (and each `None` of a step it calls) looks at the name afresh
// after a change.
fn own_dir(
    parent: &fs::File,
    name: &std::ffi::OsStr,
    path: &Path,
    euid: u32,
    last: bool,
) -> Result<(bool, fs::File)> {
    use std::os::fd::AsRawFd as _;
    let io_err = io_err_at(path);
    let cname = c_name(name).map_err(|e| io_err("using pin directory", e))?;
    let mut fresh = false;
    for _ in 0..PIN_DIR_TRIES {
        let st = match stat_at(parent, &cname) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                match mkdir_at(parent, &cname) {
                    Ok(()) => fresh = true,
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(e) => return Err(io_err("creating pin directory", e)),
                }
                continue;
            }
            Err(e) => return Err(io_err("inspecting pin directory", e)),
            Ok(st) => st,
        };
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR || st.st_uid != euid {
            let found = format!(
                "a {} of uid {} (mode {:o})",
                kind_of(st.st_mode),
                st.st_uid,
                st.st_mode & 0o7777
            );
            quarantine(parent, &cname, path, &found)?;
            fresh = true;
            continue;
        }
        let Some((file, now)) = open_verified(parent, &cname, path, &st, euid)? else {
            continue;
        };
        if !last {
            let mode = now.st_mode & 0o7777;
            // Others could otherwise swap the pin directory below it for one of theirs.
            if mode & 0o022 != 0 && mode & libc::S_ISVTX == 0 {
                // SAFETY: a descriptor we own.
                last_os_error_unless(unsafe { libc::fchmod(file.as_raw_fd(), mode & !0o022) })
                    .map_err(|e| io_err("removing others' write access to", e))?;
            }
            return Ok((fresh, file));
        }
        match lock_pin_dir(parent, &cname, path, euid, file, &now)? {
            Some(file) => return Ok((fresh, file)),
            None => fresh = true,
        }
    }
    Err(io_err(
        "creating pin directory",
        std::io::Error::other(format!(
            "something else kept taking its place ({PIN_DIR_TRIES} tries)"
        )),
    ))
}

/// Opens `name` in `parent` (whose path is `path`) as a directory without following a symlink,
/// and checks that it is the directory of user `euid` that `st` describes. Returns it with its
/// `fstat`, or `None` when it was replaced since it was looked at (to look again).
fn open_verified(
    parent: &fs::File,
    cname: &std::ffi::CStr,
    path: &Path,
    st: &libc::stat,
    euid: u32,
) -> Result<Option<(fs::File, libc::stat)>> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
    let io_err = io_err_at(path);
    // SAFETY: a descriptor we own and a NUL-terminated name.
    let fd = unsafe {
        libc::openat(
            parent.as_raw_fd(),
            cname.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        // Replaced since it was looked at: look again.
        if matches!(
            e.raw_os_error(),
            Some(libc::ENOENT | libc::ELOOP | libc::ENOTDIR)
        ) {
            return Ok(None);
        }
        return Err(io_err("opening pin directory", e));
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    let file = unsafe { fs::File::from_raw_fd(fd) };
    // SAFETY: all-zero is a valid `stat`.
    let mut now: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a descriptor we own and a `stat` to write.
    last_os_error_unless(unsafe { libc::fstat(fd, &mut now) })
        .map_err(|e| io_err("inspecting pin directory", e))?;
    if (now.st_dev, now.st_ino, now.st_uid) != (st.st_dev, st.st_ino, euid) {
        return Ok(None);
    }
    Ok(Some((file, now)))
}

/// Makes the opened pin directory `file` (`now` its `fstat`) mode 0700 and takes its lock.
/// Returns it, or `None` when it was moved aside for a fresh one (locked by a process of
/// another user or while others could open it, or holding entries that are not this user's
/// pins): the caller looks again. Busy when an agent of this user holds the lock.
fn lock_pin_dir(
    parent: &fs::File,
    cname: &std::ffi::CStr,
    path: &Path,
    euid: u32,
    file: fs::File,
    now: &libc::stat,
) -> Result<Option<fs::File>> {
    use std::os::fd::AsRawFd as _;
    let io_err = io_err_at(path);
    let fd = file.as_raw_fd();
    let mode = now.st_mode & 0o7777;
    let loose = mode != 0o700;
    if loose {
        // SAFETY: a descriptor we own.
        last_os_error_unless(unsafe { libc::fchmod(fd, 0o700) })
            .map_err(|e| io_err("setting mode 0700 on pin directory", e))?;
    }
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io_err("locking pin directory", e));
        }
        // No agent runs in a directory others could open, nor as another user: whoever
        // holds the lock then is not one (another user may have opened the directory while
        // its mode let them, and kept it open).
        let holder = foreign_lock_holder(now, euid);
        if !loose && holder.is_none() {
            return Err(DataplaneError::PinDirBusy(path.to_path_buf()));
        }
        drop(file);
        let found = format!(
            "a directory of mode {mode:o} locked by {}",
            holder.as_deref().unwrap_or("another process")
        );
        quarantine(parent, cname, path, &found)?;
        return Ok(None);
    }
    if let Some(found) = foreign_entry(path, euid) {
        drop(file);
        quarantine(parent, cname, path, &format!("a directory holding {found}"))?;
        return Ok(None);
    }
    Ok(Some(file))
}

/// The error of a step (`what`) on `path` that failed with `source`, as every step of owning
/// the pin directory reports it.
fn io_err_at(path: &Path) -> impl Fn(&'static str, std::io::Error) -> DataplaneError + '_ {
    move |what, source| DataplaneError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Who holds the `flock` on the directory `st` describes, when that is a process whose
/// effective user is not `euid` (from /proc/locks and the holder's /proc/PID/status): `None`
/// when it runs as `euid` or cannot be told.
fn foreign_lock_holder(st: &libc::stat, euid: u32) -> Option<String> {
    let locks = fs::read_to_string("/proc/locks").ok()?;
    let (major, minor) = (libc::major(st.st_dev), libc::minor(st.st_dev));
    let file = format!("{major:02x}:{minor:02x}:{}", st.st_ino);
    for line in locks.lines() {
        // "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" ("->" marks a waiter).
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(1) != Some(&"FLOCK") || f.get(5) != Some(&file.as_str()) {
            continue;
        }
        let Some(pid) = f.get(4).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|u| u.parse::<u32>().ok())?;
        return (uid != euid).then(|| format!("process {pid} of uid {uid}"));
    }
    None
}

/// The first entry of the (verified, locked) directory `dir` that none of this user's pins could
/// be: an entry of another user, or anything but a file (a pin is one; users without CAP_BPF can
/// create directories and symlinks on a bpffs, never pins).
fn foreign_entry(dir: &Path, euid: u32) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => return Some(format!("entries that cannot be listed ({e})")),
    };
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => return Some(format!("entries that cannot be listed ({e})")),
        };
        let meta = match fs::symlink_metadata(entry.path()) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Some(format!(
                    "{:?}, which cannot be inspected ({e})",
                    entry.file_name()
                ))
            }
        };
        if meta.uid() != euid || !meta.file_type().is_file() {
            return Some(format!(
                "{:?}, a {} of uid {}",
                entry.file_name(),
                kind_of(meta.mode()),
                meta.uid()
            ));
        }
    }
    None
}

/// Moves what is at `name` in `parent` (whose path is `path`) aside to a fresh
/// `NAME_quarantine_PID_RANDOM` in the same parent (bpffs refuses names with a dot), putting a
/// new empty directory of this user (mode 0700) in its place in the same rename
/// (`RENAME_EXCHANGE`): the name is never free for someone else to take. Root may rename other users' entries in a sticky directory it owns (a
/// bpffs root), and a directory within its parent without write access to it.
fn quarantine(parent: &fs::File, name: &std::ffi::CStr, path: &Path, found: &str) -> Result<()> {
    let io_err = io_err_at(path);
    let base = path.file_name().unwrap_or_default().to_string_lossy();
    for _ in 0..PIN_DIR_TRIES {
        let mut random = [0u8; 8];
        // SAFETY: writes at most 8 bytes into `random`.
        let n = unsafe { libc::getrandom(random.as_mut_ptr().cast(), random.len(), 0) };
        if n != 8 {
            return Err(io_err(
                "moving aside what was found at",
                std::io::Error::last_os_error(),
            ));
        }
        let aside_name = format!(
            "{base}_quarantine_{}_{:016x}",
            std::process::id(),
            u64::from_le_bytes(random)
        );
        let aside = c_name(aside_name.as_ref()).map_err(|e| io_err("using pin directory", e))?;
        match mkdir_at(parent, &aside) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => return Err(io_err("creating a directory to replace", e)),
        }
        let moved_to = path.with_file_name(&aside_name);
        let removed_aside = || {
            use std::os::fd::AsRawFd as _;
            // SAFETY: a descriptor we own and a NUL-terminated name.
            unsafe { libc::unlinkat(parent.as_raw_fd(), aside.as_ptr(), libc::AT_REMOVEDIR) };
        };
        for _ in 0..PIN_DIR_TRIES {
            match rename_at(parent, &aside, name, libc::RENAME_EXCHANGE) {
                Ok(()) => {
                    tracing::warn!(
                        pin_dir = %path.display(),
                        found = %found,
                        moved_to = %moved_to.display(),
                        "the pin directory's path held something this agent neither uses nor \
                         trusts (planted by another user?): moved it aside"
                    );
                    return Ok(());
                }
                // Gone in the meantime: put the fresh directory there, unless someone was faster.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => {
                    removed_aside();
                    return Err(io_err("moving aside what was found at", e));
                }
            }
            match rename_at(parent, &aside, name, libc::RENAME_NOREPLACE) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => {
                    removed_aside();
                    return Err(io_err("creating pin directory", e));
                }
            }
        }
        // The caller looks again.
        removed_aside();
        return Ok(());
    }
    Err(io_err(
        "moving aside what was found at",
        std::io::Error::other("no free quarantine name"),
    ))
}

pub(super) fn remove_link_pin(pin: &Path) -> Result<()> {
    match fs::remove_file(pin) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DataplaneError::Io {
            what: "removing pinned link",
            path: pin.to_path_buf(),
            source,
        }),
    }
}

/// Removes every pinned link in `dir` (links of interfaces this agent did not attach to, left by
/// an earlier agent): with no other reference, each link is released and its program detached.
pub fn remove_link_pins(dir: &Path) -> Result<()> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with("link_") {
            remove_link_pin(&entry.path())?;
        }
    }
    Ok(())
}

/// Checks that `dir` is a directory of this user (for `ratelimit detach --pin-path`, before
/// [`remove_pin_dir`]), not a symlink (which `detach` would follow,
/// removing files named like pins wherever another user pointed it) nor another user's
/// directory (an agent's pin directory is its own: see `prepare_pin_dir`).
pub fn check_own_pin_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let refuse = |why: String| DataplaneError::Io {
        what: "using pin directory",
        path: dir.to_path_buf(),
        source: std::io::Error::other(why),
    };
    let meta = fs::symlink_metadata(dir).map_err(|source| DataplaneError::Io {
        what: "inspecting pin directory",
        path: dir.to_path_buf(),
        source,
    })?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if meta.file_type().is_symlink() {
        return Err(refuse(
            "it is a symlink, not followed (anyone may plant one on a bpffs of mode 1777): name \
             the pin directory itself"
                .into(),
        ));
    }
    if !meta.is_dir() {
        return Err(refuse("it is not a directory".into()));
    }
    if meta.uid() != euid {
        return Err(refuse(format!(
            "it belongs to uid {}, not to this user (uid {euid}): not an agent's pin directory",
            meta.uid()
        )));
    }
    Ok(())
}

/// Detaches and removes everything a (possibly dead) agent left in `pin_dir`: pinned links (so
/// the interfaces stop running the program) and pinned maps. For `ratelimit detach` without a
/// running agent.
pub fn remove_pin_dir(pin_dir: &Path) -> Result<()> {
    remove_link_pins(pin_dir)?;
    maps::remove_pins(pin_dir).map_err(|source| DataplaneError::Io {
        what: "removing pinned maps in",
        path: pin_dir.to_path_buf(),
        source,
    })
}
