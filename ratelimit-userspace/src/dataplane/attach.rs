//! Loading the XDP program with its maps pinned (and the bucket store seeded), attaching it to
//! interfaces through pinned bpf_links or adopting the links an earlier agent pinned, detaching,
//! and removing it all.

use std::{fs, path::PathBuf};

use aya::{
    programs::{
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
        Xdp, XdpMode,
    },
    Ebpf, EbpfLoader,
};
use ratelimit_common::{bucket_capacity, map_names, BUCKET_WAYS, PROGRAM_NAME};

use super::{
    bpffs::{ensure_bpffs, warn_if_private_bpffs},
    gro_enabled, ifindex,
    install::IdSet,
    interface_exists, link_pin_name,
    pins::{prepare_pin_dir, remove_link_pin},
    remove_pin_dir, AttachMode, Attachment, Dataplane, DataplaneError, LinkHealth, LoadOptions,
    Result, OBJECT,
};
use crate::maps::{self, PinnedMaps};

impl Dataplane {
    /// Loads the program, creating (or reusing) the pinned maps under `opts.pin_dir`.
    pub fn load(opts: &LoadOptions) -> Result<Self> {
        if OBJECT.is_empty() {
            return Err(DataplaneError::NoObject);
        }
        ensure_bpffs(&opts.pin_dir)?;
        warn_if_private_bpffs(&opts.pin_dir);
        // Locked before anything in the directory is read or written: another agent's pins are
        // its own.
        let (fresh, lock) = prepare_pin_dir(&opts.pin_dir)?;
        let loaded = Self::load_pinned(opts, lock);
        if loaded.is_err() && fresh {
            // We created the pins: a failed load leaves nothing behind.
            let _ = maps::remove_pins(&opts.pin_dir);
        }
        loaded
    }

    fn load_pinned(opts: &LoadOptions, lock: fs::File) -> Result<Self> {
        maps::check_pinned(&opts.pin_dir, opts.max_buckets)?;
        let other = match &opts.object {
            Some(path) => Some(fs::read(path).map_err(|e| {
                DataplaneError::Load(format!("reading the XDP object {}: {e}", path.display()))
            })?),
            None => None,
        };
        // How far the program's coarse clock may lag the true time on this kernel: several of its
        // ticks (see `ratelimit_common::COARSE_LAG_TICKS`); the compiler chooses the clocks by the
        // same figure. Not required of the object (one built before the global keeps its own
        // constant, which is larger than any tick's allowance: safe, only more withheld).
        let coarse_lag = crate::compile::coarse_lag_ns();
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&opts.pin_dir)
            .map_max_entries(map_names::BUCKETS, bucket_capacity(opts.max_buckets))
            .map_max_entries(
                map_names::NEW_PAGES,
                ratelimit_common::new_pages_words(bucket_capacity(opts.max_buckets)),
            )
            .map_max_entries(
                map_names::BUCKET_TAGS,
                ratelimit_common::bucket_tag_lines(bucket_capacity(opts.max_buckets)),
            )
            .override_global(ratelimit_common::COARSE_LAG_GLOBAL, &coarse_lag, false)
            .load(other.as_deref().unwrap_or(OBJECT))
            .map_err(|e| DataplaneError::Load(format!("{e:#}")))?;
        let program = xdp_program(&mut ebpf)?;
        program
            .load()
            .map_err(|e| DataplaneError::Load(verifier_error(&e)))?;
        let mut maps = PinnedMaps::open(&opts.pin_dir)?;
        init_store(&mut maps)?;
        let live_ids = IdSet::from_ids(maps.named_rules()?.into_keys());
        Ok(Self {
            ebpf,
            maps,
            attachments: Vec::new(),
            live_ids,
            records: Vec::new(),
            mirror: None,
            internal_at_install: None,
            lock,
        })
    }

    /// Attaches to `iface`. In [`AttachMode::Auto`], native mode is tried first and generic mode
    /// used where the driver refuses. If a previous agent left a pinned link for `iface` in the
    /// pin directory, that link is switched over to this program atomically instead (no packet
    /// goes unlimited in between) and `mode` is ignored.
    pub fn attach(&mut self, iface: &str, mode: AttachMode) -> Result<&Attachment> {
        if !interface_exists(iface) {
            return Err(DataplaneError::NoSuchInterface(iface.to_string()));
        }
        let pin = self.pin_dir().join(link_pin_name(iface));
        if pin.exists() {
            return self.adopt(iface, pin);
        }
        let tries: &[(XdpMode, &'static str)] = match mode {
            AttachMode::Auto => &[(XdpMode::Driver, "native"), (XdpMode::Skb, "skb")],
            AttachMode::Native => &[(XdpMode::Driver, "native")],
            AttachMode::Skb => &[(XdpMode::Skb, "skb")],
        };
        let program = xdp_program(&mut self.ebpf)?;
        let mut last = None;
        for &(xdp_mode, name) in tries {
            let attach_err = |reason: String| DataplaneError::Attach {
                iface: iface.to_string(),
                mode: name,
                reason,
            };
            match program.attach(iface, xdp_mode) {
                Ok(id) => {
                    let link = program
                        .take_link(id)
                        .map_err(|e| attach_err(error_chain(&e)))?;
                    // Only a bpf_link can be pinned; aya falls back to netlink on kernels without
                    // XDP links (< 5.9), which this agent does not support.
                    let link = FdLink::try_from(link).map_err(|e| {
                        attach_err(format!(
                            "not a bpf_link (kernel too old?): {}",
                            error_chain(&e)
                        ))
                    })?;
                    let pinned = link.pin(&pin).map_err(|e| {
                        attach_err(format!("pinning the link at {}: {e}", pin.display()))
                    })?;
                    let link = FdLink::from(pinned);
                    let ifindex = ifindex(iface);
                    if name == "skb" && gro_enabled(iface) == Some(true) {
                        // The kernel runs a generic XDP program after GRO, once per merged
                        // buffer: up to 64 segments of a TCP flow then take one packet token.
                        tracing::warn!(
                            iface,
                            "attached in skb (generic) mode with GRO on: a packet limit counts \
                             each buffer GRO merged as one packet (up to 64 segments of a TCP \
                             flow), so it admits up to that many times its rate of such traffic; \
                             byte limits count every byte. Native mode sees every frame; or turn \
                             GRO off (`ethtool -K {iface} gro off`)"
                        );
                    }
                    self.attachments.push(Attachment {
                        iface: iface.to_string(),
                        mode: name,
                        ifindex,
                        link,
                        pin,
                    });
                    return Ok(self.attachments.last().expect("just pushed"));
                }
                Err(e) => {
                    tracing::debug!(iface, mode = name, error = %e, "attach failed");
                    if matches!(os_error(&e), Some(libc::EBUSY | libc::EEXIST)) {
                        // EBUSY: a program is attached in this mode; EEXIST: in the other mode.
                        // Either way no other mode can help.
                        return Err(attach_err(format!(
                            "{iface} already has an XDP program attached (another ratelimit agent \
                             with another pin_path, or another XDP tool; `ip link show dev {iface}` \
                             shows it): detach it first ({})",
                            error_chain(&e)
                        )));
                    }
                    last = Some(attach_err(error_chain(&e)));
                }
            }
        }
        Err(last.expect("at least one mode tried"))
    }

    /// Switches the link a previous agent pinned for `iface` over to this program.
    fn adopt(&mut self, iface: &str, pin: PathBuf) -> Result<&Attachment> {
        let attach_err = |reason: String| DataplaneError::Attach {
            iface: iface.to_string(),
            mode: "adopted",
            reason,
        };
        let old = PinnedLink::from_pin(&pin).map_err(|e| {
            attach_err(format!(
                "opening pinned link {}: {}",
                pin.display(),
                error_chain(&e)
            ))
        })?;
        let link = XdpLink::try_from(FdLink::from(old)).map_err(|e| {
            attach_err(format!(
                "pinned link {} is not an XDP link: {}",
                pin.display(),
                error_chain(&e)
            ))
        })?;
        let program = xdp_program(&mut self.ebpf)?;
        // bpf_link_update: the interface runs the old program until this call and ours after it.
        let id = program
            .attach_to_link(link)
            .map_err(|e| attach_err(error_chain(&e)))?;
        let link = program
            .take_link(id)
            .map_err(|e| attach_err(error_chain(&e)))?;
        let link = FdLink::try_from(link).map_err(|e| attach_err(error_chain(&e)))?;
        let ifindex = ifindex(iface);
        // One record per interface: adopting a link this agent already holds replaces its record.
        self.attachments.retain(|a| a.iface != iface);
        self.attachments.push(Attachment {
            iface: iface.to_string(),
            mode: "adopted",
            ifindex,
            link,
            pin,
        });
        Ok(self.attachments.last().expect("just pushed"))
    }

    /// Whether the interface the program was attached to as `iface` is still there (`None`: not
    /// attached to `iface`). By interface index: an interface created again in the same instant
    /// with the same index would go unnoticed, which the kernel's cyclic index allocation makes
    /// unlikely.
    #[must_use]
    pub fn link_health(&self, iface: &str) -> Option<LinkHealth> {
        let att = self.attachments.iter().find(|a| a.iface == iface)?;
        Some(match ifindex(iface) {
            0 => LinkHealth::Missing,
            now if now == att.ifindex => LinkHealth::Attached,
            _ => LinkHealth::Replaced,
        })
    }

    /// Attaches to `iface` afresh, after the interface it was attached to went away (see
    /// [`Dataplane::link_health`]): the defunct link and its pin are dropped first.
    pub fn reattach(&mut self, iface: &str, mode: AttachMode) -> Result<&Attachment> {
        self.detach(iface)?;
        self.attach(iface, mode)
    }

    /// Detaches from `iface` (removes its pinned link); returns whether it was attached.
    pub fn detach(&mut self, iface: &str) -> Result<bool> {
        let Some(pos) = self.attachments.iter().position(|a| a.iface == iface) else {
            return Ok(false);
        };
        let att = self.attachments.remove(pos);
        remove_link_pin(&att.pin)?;
        // Closing the last reference to an unpinned link detaches the program.
        drop(att.link);
        Ok(true)
    }

    /// Detaches from every interface.
    pub fn detach_all(&mut self) -> Result<()> {
        let ifaces: Vec<String> = self.attachments.iter().map(|a| a.iface.clone()).collect();
        for iface in ifaces {
            self.detach(&iface)?;
        }
        Ok(())
    }

    /// Leaves every attachment, map and pin in place and lets go of them: the limiter keeps
    /// enforcing with the rules in force, and the next agent adopts it all.
    pub fn keep_attached(self) {
        drop(self);
    }

    /// Detaches everything, unloads the program and removes the pinned maps.
    pub fn remove(mut self) -> Result<()> {
        self.detach_all()?;
        let dir = self.pin_dir().to_path_buf();
        // The lock goes last, so that no other agent adopts a directory being emptied.
        let Self {
            ebpf,
            maps,
            attachments,
            lock,
            ..
        } = self;
        drop((ebpf, maps, attachments));
        let removed = remove_pin_dir(&dir);
        drop(lock);
        removed
    }
}

/// Gives a bucket store its secret seed and its number of sets, once: a store adopted from an
/// earlier agent keeps the seed it was filled under, or its buckets could not be found again.
fn init_store(maps: &mut PinnedMaps) -> Result<()> {
    let config = maps.config()?;
    let sets = maps.bucket_capacity()? / BUCKET_WAYS;
    if config.seed != [0, 0] && config.bucket_sets == sets {
        return Ok(());
    }
    // New pins: this version's layout stamp goes with the seed.
    let mut seed = [0u64; 2];
    while seed == [0, 0] {
        let mut bytes = [0u8; 16];
        // SAFETY: writes at most 16 bytes into `bytes`.
        let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
        if n != 16 {
            return Err(DataplaneError::Load(format!(
                "drawing the bucket store's seed: {}",
                std::io::Error::last_os_error()
            )));
        }
        seed = [
            u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes")),
        ];
    }
    maps.update_config(|c| {
        c.seed = seed;
        c.bucket_sets = sets;
        c.layout = ratelimit_common::layout::STAMP;
    })?;
    Ok(())
}

fn xdp_program(ebpf: &mut Ebpf) -> Result<&mut Xdp> {
    ebpf.program_mut(PROGRAM_NAME)
        .ok_or_else(|| DataplaneError::Load(format!("no program {PROGRAM_NAME} in the object")))?
        .try_into()
        .map_err(|e| DataplaneError::Load(format!("{e}")))
}

/// The OS error number somewhere in the error's source chain.
fn os_error(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(code) = err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
        {
            return Some(code);
        }
        next = err.source();
    }
    None
}

/// The error and its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// Program load errors carry the verifier log; keep its tail, which says what was rejected.
fn verifier_error(e: &aya::programs::ProgramError) -> String {
    let full = format!("{e:#}");
    let lines: Vec<&str> = full.lines().collect();
    if lines.len() <= 40 {
        return full;
    }
    format!(
        "{}\n...\n{}",
        lines[0],
        lines[lines.len() - 30..].join("\n")
    )
}
