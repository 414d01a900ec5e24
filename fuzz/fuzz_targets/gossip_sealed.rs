//! Past the seal: what an authenticated peer's datagrams carry. Each input is sealed with the
//! cluster key, as a member with the key (compromised or buggy) would seal it, and sent over
//! loopback to the agent's real gossip transport (`cluster::transport::SecureTransport`), which
//! opens it and hands the plaintext to chitchat's own socket and decoder. Whatever the plaintext,
//! the transport and chitchat decode it or drop it, never a panic; and anything decoded is
//! reported as coming from the peer that sealed it.
//!
//! After each input a second peer sends a known envelope (sealed the same way), so the target
//! knows when the transport is done with the input without waiting on a timer.
#![no_main]

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use chitchat::{
    transport::{Socket, Transport},
    ChitchatEnvelope, ChitchatMessage, ProtocolVersion,
};
use libfuzzer_sys::fuzz_target;
use ratelimit::cluster::{
    key::ClusterKey,
    status::Shared,
    transport::SecureTransport,
    wire::{Codec, MAX_MESSAGE, REPLAY_CAPACITY},
};

const SECRET: &[u8] = b"a fuzzing secret, long enough for the key file\n";
const CLUSTER: &str = "fuzz";
/// Guards against a hang only: every input is followed by the sentinel, which always arrives.
const RECV_TIMEOUT: Duration = Duration::from_secs(10);

struct Bed {
    rt: tokio::runtime::Runtime,
    transport: SecureTransport,
    /// The transport's socket, its public address, and the inputs it has taken.
    socket: Mutex<(Box<dyn Socket>, SocketAddr, usize)>,
    /// The peer whose datagrams are the fuzzer's, and its sealing codec.
    peer: (UdpSocket, Mutex<Codec>),
    /// The peer that sends the sentinel after each input, its codec, and the sentinel's
    /// plaintext.
    marker: (UdpSocket, Mutex<Codec>, Vec<u8>),
}

/// Wall-clock Unix milliseconds (what the transport checks a datagram's age against).
fn unix_ms() -> u64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970");
    u64::try_from(since.as_millis()).expect("ms fit")
}

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET, CLUSTER).expect("long enough")
}

fn sentinel() -> ChitchatEnvelope {
    ChitchatEnvelope {
        version: ProtocolVersion::V1,
        message: ChitchatMessage::BadCluster,
    }
}

fn bed() -> &'static Bed {
    static BED: OnceLock<Bed> = OnceLock::new();
    BED.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let key = key();
        let transport =
            SecureTransport::new(self::key(), CLUSTER.into(), Arc::new(Shared::default()));
        let mut socket = rt
            .block_on(transport.open((Ipv4Addr::LOCALHOST, 0).into()))
            .expect("gossip socket");
        let bind = || UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).expect("peer socket");
        let (peer_socket, marker) = (bind(), bind());
        let (peer, marker_addr) = (
            peer_socket.local_addr().unwrap(),
            marker.local_addr().unwrap(),
        );
        // The transport's public address: the one it seals from when it sends.
        rt.block_on(socket.send(marker.local_addr().unwrap(), sentinel()))
            .expect("send the sentinel");
        let mut buf = vec![0; 65_536];
        let (len, public) = marker.recv_from(&mut buf).expect("the sealed sentinel");
        let mut opener = Codec::new(&key, CLUSTER, marker.local_addr().unwrap());
        let plain = opener
            .open(&buf[..len], public, unix_ms())
            .expect("opens")
            .expect("one part");
        Bed {
            rt,
            socket: Mutex::new((socket, public, 0)),
            transport,
            peer: (peer_socket, Mutex::new(Codec::new(&key, CLUSTER, peer))),
            marker: (
                marker,
                Mutex::new(Codec::new(&key, CLUSTER, marker_addr)),
                plain,
            ),
        }
    })
}

fn send(from: &UdpSocket, codec: &Mutex<Codec>, message: &[u8], to: SocketAddr) {
    let parts = codec
        .lock()
        .unwrap()
        .seal(message, to, unix_ms())
        .expect("within MAX_MESSAGE");
    for part in parts {
        from.send_to(&part, to).expect("loopback send");
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() > MAX_MESSAGE {
        return;
    }
    let bed = bed();
    let (peer, marker) = (
        bed.peer.0.local_addr().unwrap(),
        bed.marker.0.local_addr().unwrap(),
    );
    let mut guard = bed.socket.lock().unwrap();
    // The replay window refuses datagrams once it holds `REPLAY_CAPACITY` from the last minute,
    // and the fuzzer sends far faster than peers do: start over on a fresh socket (a restarted
    // agent) before it fills (each input is at most 4 parts and the sentinel).
    if guard.2 >= REPLAY_CAPACITY / 8 {
        let socket = bed
            .rt
            .block_on(bed.transport.open((Ipv4Addr::LOCALHOST, 0).into()))
            .expect("gossip socket");
        let public = socket.local_addr().expect("bound");
        *guard = (socket, public, 0);
    }
    guard.2 += 1;
    let public = guard.1;
    let socket = &mut guard.0;
    send(&bed.peer.0, &bed.peer.1, data, public);
    send(&bed.marker.0, &bed.marker.1, &bed.marker.2, public);
    bed.rt.block_on(async {
        loop {
            let got = tokio::time::timeout(RECV_TIMEOUT, socket.recv())
                .await
                .expect("the sentinel did not come through")
                .expect("the gossip socket failed");
            if got.from_addr == marker {
                assert_eq!(got.envelope, sentinel(), "the sentinel changed");
                break;
            }
            // The input decoded: it is reported as the authenticated peer's.
            assert_eq!(got.from_addr, peer, "decoded from the wrong peer");
        }
    });
});
