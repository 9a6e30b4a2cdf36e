//! A loopback proxy that counts round trips on the wire.
//!
//! The counting pass points a store (and the raw baseline) at the proxy
//! instead of the server. The proxy copies bytes both ways untouched and
//! parses one direction just far enough to count the requests a client
//! waits on:
//!
//! - PostgreSQL: `ReadyForQuery` (`Z`) messages from the server. Every
//!   simple query and every extended-protocol `Sync` ends in exactly one, so
//!   they are the round trips, whatever sqlx pipelines before the `Sync`.
//! - MySQL / MariaDB: command packets from the client (sequence id 0),
//!   except `COM_STMT_CLOSE` and `COM_QUIT`, which get no answer.
//! - Redis: commands from the client (RESP arrays). A script is one command
//!   (`EVALSHA`) however many commands it runs inside Redis.
//!
//! TLS would hide the messages, so the proxied URLs turn it off
//! (`sslmode=disable`, `ssl-mode=disabled`); it is loopback only.
//! Connection set-up (authentication, session settings) happens before the
//! counting window opens and is not counted.
//!
//! sqlx pings every connection handed back to its pool (a bare `Sync` on
//! PostgreSQL, `COM_PING` on MySQL): one round trip per checkout, off the
//! caller's path but on the wire. Those are counted as requests and, apart,
//! as pings (a PostgreSQL `ReadyForQuery` right after another one is a bare
//! `Sync`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::error::{BenchError, Result};
use crate::limits::MAX_WIRE_HEADER_BYTES;

/// The protocol a proxy parses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// PostgreSQL frontend/backend protocol 3.
    Postgres,
    /// MySQL client/server protocol.
    MySql,
    /// Redis RESP.
    Redis,
}

/// Requests counted, and whether the parser lost track of the stream.
#[derive(Debug, Default)]
struct Tally {
    requests: AtomicU64,
    pings: AtomicU64,
    lost: AtomicBool,
}

/// What a parser counted in some bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Requests the client waited on (pings included).
    pub requests: u64,
    /// Of those, connection pings.
    pub pings: u64,
}

/// A running proxy. Dropping it stops it and every connection through it.
#[derive(Debug)]
pub(crate) struct WireProxy {
    local_addr: std::net::SocketAddr,
    tally: Arc<Tally>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for WireProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl WireProxy {
    /// Listens on a free loopback port and forwards to `upstream`
    /// (`host:port`).
    ///
    /// # Errors
    /// `Io` when no port can be bound.
    pub(crate) async fn start(upstream: String, protocol: Protocol) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| BenchError::io("cannot bind the counting proxy", e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| BenchError::io("cannot read the proxy's address", e))?;
        let tally = Arc::new(Tally::default());
        let accept_tally = Arc::clone(&tally);
        let accept = tokio::spawn(async move {
            // Aborting the accept task drops the set, which aborts every
            // connection task with it.
            let mut connections = JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                connections.spawn(relay(
                    inbound,
                    upstream.clone(),
                    protocol,
                    Arc::clone(&accept_tally),
                ));
            }
        });
        Ok(Self {
            local_addr,
            tally,
            accept,
        })
    }

    /// The proxy's `127.0.0.1:port`.
    pub(crate) fn host_port(&self) -> String {
        self.local_addr.to_string()
    }

    /// Requests and pings counted so far; `None` if the parser lost track.
    pub(crate) fn counts(&self) -> Option<Counts> {
        (!self.tally.lost.load(Ordering::SeqCst)).then(|| Counts {
            requests: self.tally.requests.load(Ordering::SeqCst),
            pings: self.tally.pings.load(Ordering::SeqCst),
        })
    }
}

async fn relay(inbound: TcpStream, upstream: String, protocol: Protocol, tally: Arc<Tally>) {
    let Ok(outbound) = TcpStream::connect(&upstream).await else {
        tracing::warn!(%upstream, "counting proxy cannot reach the server");
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (client_read, client_write) = inbound.into_split();
    let (server_read, server_write) = outbound.into_split();
    let parser = Parser::new(protocol);
    let (to_server, to_client) = match protocol {
        // PostgreSQL is counted on the server's answers, the others on the
        // client's requests.
        Protocol::Postgres => (None, Some(parser)),
        Protocol::MySql | Protocol::Redis => (Some(parser), None),
    };
    let upstream_copy = pump(client_read, server_write, to_server, Arc::clone(&tally));
    let downstream_copy = pump(server_read, client_write, to_client, tally);
    tokio::join!(upstream_copy, downstream_copy);
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut parser: Option<Parser>,
    tally: Arc<Tally>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if let Some(parser) = parser.as_mut() {
            match parser.feed(&buffer[..read]) {
                Some(counts) => {
                    tally.requests.fetch_add(counts.requests, Ordering::SeqCst);
                    tally.pings.fetch_add(counts.pings, Ordering::SeqCst);
                }
                None => tally.lost.store(true, Ordering::SeqCst),
            }
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// An incremental parser: bytes in, requests counted.
#[derive(Debug)]
pub(crate) enum Parser {
    /// PostgreSQL backend messages: 1 type byte, 4 length bytes (counting
    /// themselves), body.
    Postgres {
        header: Vec<u8>,
        skip: usize,
        /// The previous message was a `ReadyForQuery`.
        after_ready: bool,
    },
    /// MySQL packets: 3 length bytes (little-endian), 1 sequence byte, body.
    MySql {
        header: Vec<u8>,
        skip: usize,
        /// A sequence-0 packet whose command byte is still to come.
        awaiting_command: bool,
    },
    /// Redis RESP requests.
    Redis { line: Vec<u8>, state: RespState },
    /// The stream stopped making sense; nothing more is counted.
    Lost,
}

/// Where a RESP request parser is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RespState {
    /// At the start of a request (`*<n>` or an inline command).
    Request,
    /// Expecting `$<len>` with this many arguments left after it.
    BulkHeader { left: u64 },
    /// Skipping an argument's bytes (and its CRLF).
    BulkBody { skip: u64, left: u64 },
}

/// `COM_QUIT`: the client closes; no answer.
const COM_QUIT: u8 = 0x01;
/// `COM_STMT_CLOSE`: frees a prepared statement; no answer.
const COM_STMT_CLOSE: u8 = 0x19;
/// `COM_PING`: a liveness check (sqlx sends one per pool checkout).
const COM_PING: u8 = 0x0e;

impl Parser {
    pub(crate) fn new(protocol: Protocol) -> Self {
        match protocol {
            Protocol::Postgres => Self::Postgres {
                header: Vec::with_capacity(5),
                skip: 0,
                after_ready: false,
            },
            Protocol::MySql => Self::MySql {
                header: Vec::with_capacity(4),
                skip: 0,
                awaiting_command: false,
            },
            Protocol::Redis => Self::Redis {
                line: Vec::new(),
                state: RespState::Request,
            },
        }
    }

    /// Feeds `bytes`; the requests completed in them, or `None` once lost.
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) -> Option<Counts> {
        let mut counts = Counts::default();
        while !bytes.is_empty() {
            let consumed = match self {
                Self::Postgres {
                    header,
                    skip,
                    after_ready,
                } => postgres_step(header, skip, after_ready, bytes, &mut counts),
                Self::MySql {
                    header,
                    skip,
                    awaiting_command,
                } => mysql_step(header, skip, awaiting_command, bytes, &mut counts),
                Self::Redis { line, state } => redis_step(line, state, bytes, &mut counts.requests),
                Self::Lost => None,
            };
            match consumed {
                Some(consumed) => bytes = &bytes[consumed..],
                None => {
                    *self = Self::Lost;
                    return None;
                }
            }
        }
        Some(counts)
    }
}

fn skip_bytes(skip: &mut usize, bytes: &[u8]) -> usize {
    let taken = (*skip).min(bytes.len());
    *skip -= taken;
    taken
}

fn postgres_step(
    header: &mut Vec<u8>,
    skip: &mut usize,
    after_ready: &mut bool,
    bytes: &[u8],
    counts: &mut Counts,
) -> Option<usize> {
    if *skip > 0 {
        return Some(skip_bytes(skip, bytes));
    }
    let wanted = 5 - header.len();
    let taken = wanted.min(bytes.len());
    header.extend_from_slice(&bytes[..taken]);
    if header.len() == 5 {
        let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if length < 4 {
            return None;
        }
        let ready = header[0] == b'Z';
        if ready {
            counts.requests += 1;
            if *after_ready {
                counts.pings += 1;
            }
        }
        *after_ready = ready;
        *skip = length - 4;
        header.clear();
    }
    Some(taken)
}

fn mysql_step(
    header: &mut Vec<u8>,
    skip: &mut usize,
    awaiting_command: &mut bool,
    bytes: &[u8],
    counts: &mut Counts,
) -> Option<usize> {
    if *awaiting_command {
        *awaiting_command = false;
        if !matches!(bytes[0], COM_QUIT | COM_STMT_CLOSE) {
            counts.requests += 1;
        }
        if bytes[0] == COM_PING {
            counts.pings += 1;
        }
        *skip -= 1;
        return Some(1);
    }
    if *skip > 0 {
        return Some(skip_bytes(skip, bytes));
    }
    let wanted = 4 - header.len();
    let taken = wanted.min(bytes.len());
    header.extend_from_slice(&bytes[..taken]);
    if header.len() == 4 {
        let length =
            usize::from(header[0]) | usize::from(header[1]) << 8 | usize::from(header[2]) << 16;
        let sequence = header[3];
        *skip = length;
        *awaiting_command = sequence == 0 && length > 0;
        header.clear();
    }
    Some(taken)
}

/// Reads a CRLF-terminated header line into `line`; `Some(None)` while it is
/// incomplete, `None` when it is too long to be a header.
fn take_line(line: &mut Vec<u8>, bytes: &[u8]) -> Option<(usize, bool)> {
    match bytes.iter().position(|&b| b == b'\n') {
        Some(newline) => {
            line.extend_from_slice(&bytes[..=newline]);
            (line.len() <= MAX_WIRE_HEADER_BYTES).then_some((newline + 1, true))
        }
        None => {
            line.extend_from_slice(bytes);
            (line.len() <= MAX_WIRE_HEADER_BYTES).then_some((bytes.len(), false))
        }
    }
}

fn parse_number(line: &[u8]) -> Option<i64> {
    std::str::from_utf8(line.get(1..)?)
        .ok()?
        .trim_end()
        .parse()
        .ok()
}

fn redis_step(
    line: &mut Vec<u8>,
    state: &mut RespState,
    bytes: &[u8],
    requests: &mut u64,
) -> Option<usize> {
    if let RespState::BulkBody { skip, left } = *state {
        let taken = usize::try_from(skip).unwrap_or(usize::MAX).min(bytes.len());
        let skip = skip - taken as u64;
        *state = match (skip, left) {
            (0, 0) => RespState::Request,
            (0, left) => RespState::BulkHeader { left },
            (skip, left) => RespState::BulkBody { skip, left },
        };
        return Some(taken);
    }
    let (consumed, complete) = take_line(line, bytes)?;
    if !complete {
        return Some(consumed);
    }
    let header = std::mem::take(line);
    *state = match (*state, header.first()) {
        (RespState::Request, Some(b'*')) => {
            *requests += 1;
            match parse_number(&header)? {
                arguments if arguments > 0 => RespState::BulkHeader {
                    left: u64::try_from(arguments).ok()?,
                },
                _ => RespState::Request,
            }
        }
        (RespState::Request, _) => {
            // An inline command (a line of words) or a stray empty line.
            if header.iter().any(|b| !b.is_ascii_whitespace()) {
                *requests += 1;
            }
            RespState::Request
        }
        (RespState::BulkHeader { left }, Some(b'$')) => {
            let length = u64::try_from(parse_number(&header)?).ok()?;
            RespState::BulkBody {
                skip: length + 2,
                left: left - 1,
            }
        }
        _ => return None,
    };
    Some(consumed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_in_pieces(protocol: Protocol, stream: &[u8]) -> Option<(u64, u64)> {
        // Whole, then one byte at a time: the count must not depend on how
        // the stream is cut.
        let whole = Parser::new(protocol).feed(stream);
        let mut parser = Parser::new(protocol);
        let mut total = Counts::default();
        for byte in stream {
            let counts = parser.feed(std::slice::from_ref(byte))?;
            total.requests += counts.requests;
            total.pings += counts.pings;
        }
        assert_eq!(whole, Some(total));
        whole.map(|c| (c.requests, c.pings))
    }

    #[test]
    fn postgres_counts_ready_for_query() {
        let mut stream = Vec::new();
        // ParseComplete, BindComplete, DataRow with a body, CommandComplete, ReadyForQuery.
        stream.extend_from_slice(&[b'1', 0, 0, 0, 4, b'2', 0, 0, 0, 4]);
        stream.extend_from_slice(&[b'D', 0, 0, 0, 10, 0, 1, b'Z', b'Z', 0, 2]);
        stream.extend_from_slice(&[b'C', 0, 0, 0, 5, 0, b'Z', 0, 0, 0, 5, b'I']);
        stream.extend_from_slice(&[b'Z', 0, 0, 0, 5, b'T']);
        // A bare Sync's answer (a ping): ReadyForQuery right after another.
        stream.extend_from_slice(&[b'Z', 0, 0, 0, 5, b'I']);
        assert_eq!(feed_in_pieces(Protocol::Postgres, &stream), Some((3, 2)));
        assert_eq!(
            Parser::new(Protocol::Postgres).feed(&[b'Z', 0, 0, 0, 1]),
            None
        );
    }

    #[test]
    fn mysql_counts_commands_that_get_an_answer() {
        let mut stream = Vec::new();
        // COM_QUERY "SELECT 1", COM_STMT_EXECUTE, COM_STMT_CLOSE, a seq-1 packet.
        stream.extend_from_slice(&[9, 0, 0, 0, 0x03]);
        stream.extend_from_slice(b"SELECT 1");
        stream.extend_from_slice(&[3, 0, 0, 0, 0x17, 1, 2]);
        stream.extend_from_slice(&[5, 0, 0, 0, COM_STMT_CLOSE, 1, 0, 0, 0]);
        stream.extend_from_slice(&[2, 0, 0, 1, 0x03, 0]);
        stream.extend_from_slice(&[1, 0, 0, 0, COM_PING]);
        assert_eq!(feed_in_pieces(Protocol::MySql, &stream), Some((3, 1)));
    }

    #[test]
    fn redis_counts_commands_not_arguments() {
        let stream = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\nx\r\n*1\r\n$4\r\nPING\r\nPING\r\n";
        // SET, the inline `x`, PING, the inline PING.
        assert_eq!(feed_in_pieces(Protocol::Redis, stream), Some((4, 0)));
        assert_eq!(Parser::new(Protocol::Redis).feed(b"*1\r\n:5\r\n"), None);
        let long = [b'*'; MAX_WIRE_HEADER_BYTES + 1];
        assert_eq!(Parser::new(Protocol::Redis).feed(&long), None);
    }

    #[tokio::test]
    async fn the_proxy_relays_and_counts() {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream_addr = upstream.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut socket, _) = upstream.accept().await.unwrap();
            let mut buffer = [0u8; 64];
            while let Ok(read) = socket.read(&mut buffer).await {
                if read == 0 || socket.write_all(b"+PONG\r\n").await.is_err() {
                    break;
                }
            }
        });
        let proxy = WireProxy::start(upstream_addr, Protocol::Redis)
            .await
            .unwrap();
        let mut client = TcpStream::connect(proxy.host_port()).await.unwrap();
        for _ in 0..3 {
            client.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
            let mut answer = [0u8; 7];
            client.read_exact(&mut answer).await.unwrap();
            assert_eq!(&answer, b"+PONG\r\n");
        }
        assert_eq!(
            proxy.counts(),
            Some(Counts {
                requests: 3,
                pings: 0
            })
        );
    }
}
