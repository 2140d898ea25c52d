//! Guards one accepted connection against a client that holds it without using it, shared by
//! every listener (webhook, probes, metrics, file server):
//!
//! - an idle timer: a connection with no request in flight for `idle_timeout` is closed. It
//!   counts requests, not bytes, so HTTP/2 PINGs or a trickled HEADERS frame do not keep a
//!   connection open, and it covers every request of a keep-alive connection, not only the
//!   first;
//! - a write timer: a write the peer does not drain for `write_timeout` (a reader that does
//!   not read) fails the connection;
//! - a bound on unsent bytes ([`tune`]): without it the kernel grows a connection's send
//!   buffer up to `tcp_wmem`'s maximum (4 MiB by default), so a reader that never reads
//!   blocks no write until the server has produced megabytes of answers for it (tens of
//!   thousands of small ones, pipelined), and the write timer may never start.
//!
//! A request is in flight from the service call until its response body is dropped (sent or
//! abandoned), so a long download is never idle.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Timers of one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Longest time without a request in flight.
    pub idle_timeout: Duration,
    /// Longest time one write may wait for the peer to read.
    pub write_timeout: Duration,
}

/// Unsent bytes one connection may queue in the kernel before its writes block: a fast reader
/// never waits on it (the kernel wakes the writer below it), a reader that does not read holds
/// its own receive window plus this.
pub const UNSENT_LOW_WATER: u32 = 16 * 1024;

/// Tunes an accepted connection: no Nagle delay (a response's last small segment would wait
/// for the peer's delayed ACK), and at most [`UNSENT_LOW_WATER`] unsent bytes, so a peer that
/// does not read blocks the next write, which starts the write timer.
pub fn tune(stream: &tokio::net::TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    socket2::SockRef::from(stream).set_tcp_notsent_lowat(UNSENT_LOW_WATER)
}

/// What the stream and the service of one connection share.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    /// When the last request ended (or the connection opened).
    idle_since: Mutex<Instant>,
    /// The reader to wake when the connection turns idle, so its idle timer starts.
    reader: Mutex<Option<Waker>>,
}

impl Activity {
    fn start(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    fn end(&self) {
        *self
            .idle_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1
            && let Some(waker) = self
                .reader
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
        {
            waker.wake();
        }
    }

    /// When the connection times out, or `None` while a request is in flight.
    fn idle_deadline(&self, idle: Duration) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = *self
            .idle_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Some(since + idle)
    }
}

/// A new connection's stream and service wrappers, sharing one activity record.
pub fn guard<I, S>(io: I, service: S, limits: ConnLimits) -> (Guarded<I>, Tracked<S>) {
    let activity = Arc::new(Activity {
        in_flight: AtomicUsize::new(0),
        idle_since: Mutex::new(Instant::now()),
        reader: Mutex::new(None),
    });
    (
        Guarded {
            inner: io,
            activity: activity.clone(),
            limits,
            idle: Box::pin(tokio::time::sleep(limits.idle_timeout)),
            write: Box::pin(tokio::time::sleep(limits.write_timeout)),
            writing: false,
        },
        Tracked {
            inner: service,
            activity,
        },
    )
}

/// The stream of a guarded connection.
pub struct Guarded<I> {
    inner: I,
    activity: Arc<Activity>,
    limits: ConnLimits,
    idle: Pin<Box<Sleep>>,
    write: Pin<Box<Sleep>>,
    /// A write is waiting for the peer and `write` is its deadline.
    writing: bool,
}

impl<I> Guarded<I> {
    pub fn get_ref(&self) -> &I {
        &self.inner
    }

    /// Checks the write timer after the inner stream answered `polled`.
    fn write_timer<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if polled.is_ready() {
            self.writing = false;
            return polled;
        }
        if !self.writing {
            self.writing = true;
            let deadline = Instant::now() + self.limits.write_timeout;
            self.write.as_mut().reset(deadline);
        }
        match self.write.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the peer did not read a response within the write timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Guarded<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if polled.is_ready() {
            return polled;
        }
        // Registered before the in-flight check: a request ending in between wakes us.
        *this
            .activity
            .reader
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
        let Some(deadline) = this.activity.idle_deadline(this.limits.idle_timeout) else {
            return Poll::Pending;
        };
        if this.idle.deadline() != deadline {
            this.idle.as_mut().reset(deadline);
        }
        match this.idle.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no request within the idle timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Guarded<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.write_timer(cx, polled)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.write_timer(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.write_timer(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.write_timer(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The service of a guarded connection: marks each request in flight until its response
/// body is dropped.
#[derive(Clone)]
pub struct Tracked<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S, B, R> tower::Service<Request<R>> for Tracked<S>
where
    S: tower::Service<Request<R>, Response = Response<B>>,
    S::Future: Send + 'static,
{
    type Response = Response<TrackedBody<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<R>) -> Self::Future {
        let request_guard = InFlight::new(self.activity.clone());
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|inner| TrackedBody {
                inner,
                _in_flight: request_guard,
            }))
        })
    }
}

/// One request in flight; it ends on drop.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: Arc<Activity>) -> Self {
        activity.start();
        Self(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A response body that keeps its request in flight until dropped.
pub struct TrackedBody<B> {
    inner: B,
    _in_flight: InFlight,
}

impl<B: Body + Unpin> Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn limits() -> ConnLimits {
        ConnLimits {
            idle_timeout: Duration::from_millis(200),
            write_timeout: Duration::from_millis(200),
        }
    }

    #[tokio::test]
    async fn a_write_the_peer_never_reads_fails() {
        let (server, _client) = tokio::io::duplex(64);
        let (mut stream, _service) = guard(server, (), limits());
        let result = tokio::time::timeout(Duration::from_secs(30), stream.write_all(&[0u8; 4096]))
            .await
            .expect("the write ends");
        let err = result.expect_err("the peer never reads");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn a_write_the_peer_reads_succeeds() {
        let (server, mut client) = tokio::io::duplex(64);
        let (mut stream, _service) = guard(server, (), limits());
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            client.read_exact(&mut buf).await.map(|_| client)
        });
        stream.write_all(&[7u8; 4096]).await.expect("written");
        let _client = reader.await.expect("join").expect("read");
    }

    #[tokio::test]
    async fn an_idle_connection_is_closed_but_not_while_a_request_is_in_flight() {
        let (server, _client) = tokio::io::duplex(64);
        let (mut stream, service) = guard(server, (), limits());
        let held = InFlight::new(service.activity.clone());
        let mut buf = [0u8; 8];
        // In flight: the read waits for data however long the idle timeout is exceeded.
        let waited = tokio::time::timeout(limits().idle_timeout * 3, stream.read(&mut buf)).await;
        assert!(
            waited.is_err(),
            "a connection with a request in flight is not idle"
        );
        drop(held);
        let closed = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buf))
            .await
            .expect("closed once idle");
        assert_eq!(
            closed.expect_err("idle").kind(),
            std::io::ErrorKind::TimedOut
        );
    }
}
