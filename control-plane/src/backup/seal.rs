//! Passphrase sealing of a backup (issue 32, item 4): the archive's bytes, encrypted and
//! authenticated in chunks with ChaCha20-Poly1305 under a key derived from the passphrase with
//! PBKDF2-HMAC-SHA256, both from `ring`. The format:
//!
//! ```text
//! magic   "innerwall-sealed-v1\n"            (20 bytes)
//! salt    16 random bytes
//! rounds  PBKDF2 iterations, u32 big-endian  (100,000 ..= 10,000,000 accepted)
//! chunks  each up to 64 KiB of the archive, sealed (+16 bytes of tag); nonce = 3 zero bytes,
//!         the chunk's number (u64 big-endian) and 1 for the last chunk, else 0; the header
//!         above is every chunk's associated data
//! ```
//!
//! The numbered nonces refuse chunks reordered or dropped, the last-chunk flag a file cut short
//! at a chunk's end, the associated data a header changed (another salt, fewer rounds). A wrong
//! passphrase and an altered file both fail the first chunk's tag: one message says either.

use std::io::{self, BufRead, Read, Write};

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use ring::rand::{SecureRandom as _, SystemRandom};

pub const MAGIC: &[u8; 20] = b"innerwall-sealed-v1\n";
const SALT: usize = 16;
const HEADER: usize = MAGIC.len() + SALT + 4;
const CHUNK: usize = 64 * 1024;
const TAG: usize = 16;
/// The iterations a new backup's key takes (OWASP's figure for PBKDF2-HMAC-SHA256).
pub const ROUNDS: u32 = 600_000;
/// The iterations a sealed file may ask for: enough to mean something, few enough that a
/// hostile file cannot hold a restore for hours.
const ROUNDS_ACCEPTED: std::ops::RangeInclusive<u32> = 100_000..=10_000_000;
/// The shortest passphrase accepted for a new backup (it guards the CA's key).
pub const MIN_PASSPHRASE: usize = 12;

/// Why a sealed file cannot be opened.
fn refused(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_owned())
}

fn key(passphrase: &[u8], salt: &[u8], rounds: u32) -> LessSafeKey {
    let mut bytes = [0u8; 32];
    let rounds = std::num::NonZeroU32::new(rounds).expect("rounds are checked to be positive");
    ring::pbkdf2::derive(ring::pbkdf2::PBKDF2_HMAC_SHA256, rounds, salt, passphrase, &mut bytes);
    LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &bytes).expect("a 32-byte key"))
}

fn nonce(counter: u64, last: bool) -> Nonce {
    let mut bytes = [0u8; 12];
    bytes[3..11].copy_from_slice(&counter.to_be_bytes());
    bytes[11] = u8::from(last);
    Nonce::assume_unique_for_key(bytes)
}

/// Seals what is written to it into `inner`; [`Writer::finish`] writes the last chunk.
pub struct Writer<W: Write> {
    inner: W,
    key: LessSafeKey,
    header: [u8; HEADER],
    buf: Vec<u8>,
    counter: u64,
}

impl<W: Write> Writer<W> {
    /// Writes the header to `inner`. The passphrase must be at least [`MIN_PASSPHRASE`] bytes.
    pub fn new(mut inner: W, passphrase: &[u8], rounds: u32) -> io::Result<Writer<W>> {
        if passphrase.len() < MIN_PASSPHRASE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the passphrase is shorter than {MIN_PASSPHRASE} bytes"),
            ));
        }
        let mut header = [0u8; HEADER];
        header[..MAGIC.len()].copy_from_slice(MAGIC);
        SystemRandom::new()
            .fill(&mut header[MAGIC.len()..MAGIC.len() + SALT])
            .map_err(|_| io::Error::other("no randomness for the salt"))?;
        header[MAGIC.len() + SALT..].copy_from_slice(&rounds.to_be_bytes());
        inner.write_all(&header)?;
        let key = key(passphrase, &header[MAGIC.len()..MAGIC.len() + SALT], rounds);
        Ok(Writer { inner, key, header, buf: Vec::with_capacity(CHUNK + TAG), counter: 0 })
    }

    fn seal(&mut self, last: bool) -> io::Result<()> {
        self.key
            .seal_in_place_append_tag(nonce(self.counter, last), Aad::from(self.header), &mut self.buf)
            .map_err(|_| io::Error::other("sealing a chunk failed"))?;
        self.inner.write_all(&self.buf)?;
        self.buf.clear();
        self.counter += 1;
        Ok(())
    }

    /// Seals what is buffered as the last chunk and gives back the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.seal(true)?;
        self.inner.flush()?;
        Ok(self.inner)
    }
}

/// Neither the key nor the plaintext buffered.
impl<W: Write> std::fmt::Debug for Writer<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("seal::Writer").field("chunks", &self.counter).finish_non_exhaustive()
    }
}

impl<W: Write> Write for Writer<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        // A full buffer is sealed only once more data comes: the last chunk is sealed by
        // `finish`, whatever its size.
        if self.buf.len() == CHUNK {
            self.seal(false)?;
        }
        let n = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Opens a sealed stream: reads the header from `inner`, then yields the archive's bytes,
/// failing on the first chunk that does not authenticate and on a stream cut short.
pub struct Reader<R: BufRead> {
    inner: R,
    key: LessSafeKey,
    header: [u8; HEADER],
    chunk: Vec<u8>,
    at: usize,
    counter: u64,
    done: bool,
}

impl<R: BufRead> Reader<R> {
    pub fn new(mut inner: R, passphrase: &[u8]) -> io::Result<Reader<R>> {
        let mut header = [0u8; HEADER];
        inner.read_exact(&mut header).map_err(|_| refused("shorter than a sealed file's header"))?;
        if &header[..MAGIC.len()] != MAGIC {
            return Err(refused("not a sealed file"));
        }
        let rounds = u32::from_be_bytes(header[MAGIC.len() + SALT..].try_into().expect("4 bytes"));
        if !ROUNDS_ACCEPTED.contains(&rounds) {
            return Err(refused(&format!(
                "its key derivation asks for {rounds} rounds, outside {}..={}",
                ROUNDS_ACCEPTED.start(),
                ROUNDS_ACCEPTED.end()
            )));
        }
        let key = key(passphrase, &header[MAGIC.len()..MAGIC.len() + SALT], rounds);
        Ok(Reader { inner, key, header, chunk: Vec::new(), at: 0, counter: 0, done: false })
    }

    /// Reads and opens the next chunk into `self.chunk`.
    fn next_chunk(&mut self) -> io::Result<()> {
        let mut sealed = Vec::with_capacity(CHUNK + TAG);
        (&mut self.inner).take((CHUNK + TAG) as u64).read_to_end(&mut sealed)?;
        // The last chunk is the one the stream ends after.
        let last = sealed.len() < CHUNK + TAG || self.inner.fill_buf()?.is_empty();
        let what = if self.counter == 0 {
            "the passphrase is wrong, or the file was altered"
        } else {
            "the file was altered or cut short"
        };
        let opened = self
            .key
            .open_in_place(nonce(self.counter, last), Aad::from(self.header), &mut sealed)
            .map_err(|_| refused(what))?;
        let len = opened.len();
        sealed.truncate(len);
        self.chunk = sealed;
        self.at = 0;
        self.counter += 1;
        self.done = last;
        Ok(())
    }
}

/// Neither the key nor the plaintext opened.
impl<R: BufRead> std::fmt::Debug for Reader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("seal::Reader").field("chunks", &self.counter).finish_non_exhaustive()
    }
}

impl<R: BufRead> Read for Reader<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.at == self.chunk.len() {
            if self.done {
                return Ok(0);
            }
            self.next_chunk()?;
        }
        let n = out.len().min(self.chunk.len() - self.at);
        out[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSPHRASE: &[u8] = b"correct horse battery";
    const FEW: u32 = 100_000;

    fn seal(data: &[u8]) -> Vec<u8> {
        let mut writer = Writer::new(Vec::new(), PASSPHRASE, FEW).unwrap();
        // Odd write sizes, so chunks straddle writes.
        for part in data.chunks(7_777) {
            writer.write_all(part).unwrap();
        }
        writer.finish().unwrap()
    }

    fn open(sealed: &[u8], passphrase: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        Reader::new(sealed, passphrase)?.read_to_end(&mut out)?;
        Ok(out)
    }

    #[test]
    fn what_is_sealed_opens_unchanged_at_every_size() {
        for len in [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 5] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let sealed = seal(&data);
            assert_eq!(sealed.len(), HEADER + len + TAG * len.div_ceil(CHUNK).max(1), "len {len}");
            assert_eq!(open(&sealed, PASSPHRASE).unwrap(), data, "len {len}");
        }
    }

    #[test]
    fn a_wrong_passphrase_or_any_change_is_refused() {
        let data = vec![7u8; 2 * CHUNK + 100];
        let sealed = seal(&data);
        let message = |r: io::Result<Vec<u8>>| r.unwrap_err().to_string();
        assert!(message(open(&sealed, b"wrong passphrase!")).contains("passphrase is wrong"));
        // A flipped bit in the header (the salt), in a chunk, in the last tag.
        for at in [MAGIC.len() + 3, HEADER + CHUNK + 20, sealed.len() - 1] {
            let mut bad = sealed.clone();
            bad[at] ^= 1;
            assert!(open(&bad, PASSPHRASE).is_err(), "a change at byte {at} was accepted");
        }
        // Cut short at a chunk's end, cut inside one, a chunk dropped, two chunks swapped.
        let one = CHUNK + TAG;
        let cut_at_chunk = &sealed[..HEADER + 2 * one];
        assert!(message(open(cut_at_chunk, PASSPHRASE)).contains("cut short"));
        assert!(open(&sealed[..sealed.len() - 3], PASSPHRASE).is_err());
        let dropped = [&sealed[..HEADER], &sealed[HEADER + one..]].concat();
        assert!(open(&dropped, PASSPHRASE).is_err());
        let swapped = [
            &sealed[..HEADER],
            &sealed[HEADER + one..HEADER + 2 * one],
            &sealed[HEADER..HEADER + one],
            &sealed[HEADER + 2 * one..],
        ]
        .concat();
        assert!(open(&swapped, PASSPHRASE).is_err());
        // Appended bytes make the last chunk's boundary move: refused too.
        assert!(open(&[&sealed[..], b"x"].concat(), PASSPHRASE).is_err());
    }

    #[test]
    fn hostile_headers_are_refused_before_any_work() {
        let sealed = seal(b"data");
        let mut rounds = sealed.clone();
        rounds[MAGIC.len() + SALT..HEADER].copy_from_slice(&u32::MAX.to_be_bytes());
        let e = open(&rounds, PASSPHRASE).unwrap_err().to_string();
        assert!(e.contains("rounds"), "{e}");
        assert!(open(b"innerwall-sealed-v2\nxxxxxxxxxxxxxxxxxxxxxx", PASSPHRASE).is_err());
        assert!(open(&sealed[..10], PASSPHRASE).is_err());
        let short = Writer::new(Vec::new(), b"short", FEW).err().unwrap();
        assert!(short.to_string().contains("shorter than 12"), "{short}");
    }
}
