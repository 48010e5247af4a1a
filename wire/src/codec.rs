//! The gRPC codec every service of the contract is generated with: prost encoding with small
//! starting buffers. tonic's default gives each call an 8 KiB encode and an 8 KiB decode buffer
//! up front; a replica holds one Sync call per agent for as long as the agent runs, and an idle
//! stream carries only heartbeats and acks of a few dozen bytes, so those 16 KiB were a third of
//! what an idle stream cost (PERF-4). The buffers still grow to whatever a message needs (a
//! snapshot, a flow window); only their starting size changes.

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Starting size of a call's encode and decode buffers: a heartbeat, an ack or a small delta
/// fits without a reallocation.
pub const START_BUFFER: usize = 512;

/// How much a stream encodes before it yields to the runtime (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// prost's `application/grpc+proto` with [`START_BUFFER`]-sized starting buffers.
#[derive(Debug, Clone, Copy)]
pub struct LeanCodec<T, U>(PhantomData<fn(T) -> U>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        LeanCodec(PhantomData)
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(START_BUFFER, YIELD_THRESHOLD)
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(settings())
    }
}
