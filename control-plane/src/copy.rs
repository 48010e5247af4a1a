//! Rows in PostgreSQL's binary `COPY` format
//! (<https://www.postgresql.org/docs/15/sql-copy.html#id-1.9.3.55.9.4>): a header, then per row
//! a field count and length-prefixed fields in each type's binary send format, then a trailer.
//! The bulk writes use it (flow records; rendered policy contents): the server reads rows as
//! they stream in, where a statement with array parameters parses one message of all of them.

use std::net::IpAddr;

use chrono::{DateTime, TimeZone, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::Error;

/// PostgreSQL's `PGSQL_AF_INET` / `PGSQL_AF_INET6` (not the platform's AF_INET6).
const PGSQL_AF_INET: u8 = 2;
const PGSQL_AF_INET6: u8 = 3;

#[derive(Debug)]
pub struct Rows {
    buf: Vec<u8>,
}

impl Default for Rows {
    fn default() -> Self {
        Rows::with_capacity(1 << 20)
    }
}

impl Rows {
    /// Rows expected to take about `bytes`.
    pub fn with_capacity(bytes: usize) -> Self {
        let mut buf = Vec::with_capacity(bytes);
        buf.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
        buf.extend_from_slice(&0i32.to_be_bytes()); // flags: no OIDs
        buf.extend_from_slice(&0i32.to_be_bytes()); // no header extension
        Rows { buf }
    }

    pub fn row(&mut self, fields: i16) {
        self.buf.extend_from_slice(&fields.to_be_bytes());
    }

    fn field(&mut self, bytes: &[u8]) {
        let len = i32::try_from(bytes.len()).expect("a field under 2 GiB");
        self.buf.extend_from_slice(&len.to_be_bytes());
        self.buf.extend_from_slice(bytes);
    }

    /// A NULL field.
    pub fn null(&mut self) {
        self.buf.extend_from_slice(&(-1i32).to_be_bytes());
    }
    pub fn i16(&mut self, v: i16) {
        self.field(&v.to_be_bytes());
    }
    pub fn i32(&mut self, v: i32) {
        self.field(&v.to_be_bytes());
    }
    pub fn i64(&mut self, v: i64) {
        self.field(&v.to_be_bytes());
    }
    pub fn uuid(&mut self, v: Uuid) {
        self.field(v.as_bytes());
    }
    pub fn text(&mut self, v: &str) {
        self.field(v.as_bytes());
    }
    pub fn bytea(&mut self, v: &[u8]) {
        self.field(v);
    }

    /// jsonb's binary format: version 1, then the JSON text.
    pub fn jsonb(&mut self, json: &str) {
        let len = i32::try_from(json.len() + 1).expect("a field under 2 GiB");
        self.buf.extend_from_slice(&len.to_be_bytes());
        self.buf.push(1);
        self.buf.extend_from_slice(json.as_bytes());
    }

    /// Microseconds since 2000-01-01 UTC.
    pub fn timestamptz(&mut self, t: DateTime<Utc>) -> Result<(), Error> {
        let epoch = Utc.with_ymd_and_hms(2000, 1, 1, 0, 0, 0).single().expect("a valid date");
        let micros = (t - epoch)
            .num_microseconds()
            .ok_or_else(|| Error::Invalid(format!("time {t} is out of the range the database stores")))?;
        self.i64(micros);
        Ok(())
    }

    /// inet: family, prefix length, is-cidr flag, address length, address bytes.
    pub fn inet(&mut self, addr: IpAddr) {
        match addr {
            IpAddr::V4(a) => {
                self.buf.extend_from_slice(&8i32.to_be_bytes());
                self.buf.extend_from_slice(&[PGSQL_AF_INET, 32, 0, 4]);
                self.buf.extend_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                self.buf.extend_from_slice(&20i32.to_be_bytes());
                self.buf.extend_from_slice(&[PGSQL_AF_INET6, 128, 0, 16]);
                self.buf.extend_from_slice(&a.octets());
            }
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.buf.extend_from_slice(&(-1i16).to_be_bytes());
        self.buf
    }
}

/// Bytes per `CopyData` message: the server reads each message whole before it parses a row of
/// it, so tens of megabytes in one message would wait in memory (and be copied as it grows).
const MESSAGE: usize = 256 * 1024;

/// Sends `rows` with one binary `COPY … FROM STDIN` statement.
pub async fn copy_in(conn: &mut PgConnection, statement: &'static str, rows: Rows) -> Result<(), Error> {
    let mut copy = conn.copy_in_raw(statement).await?;
    for message in rows.finish().chunks(MESSAGE) {
        copy.send(message).await?;
    }
    copy.finish().await?;
    Ok(())
}

/// The signature and header a binary `COPY … TO STDOUT` starts with (no OIDs, no extension).
const HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";

/// Rows of a binary `COPY … TO STDOUT`, parsed from its chunks as they stream in: a chunk may end
/// anywhere, even inside a field, so the bytes of a row not yet whole wait for the next.
#[derive(Debug, Default)]
pub struct Reader {
    buf: Vec<u8>,
    /// Where the next row starts in `buf`.
    at: usize,
    header: bool,
    /// The trailer has been read.
    done: bool,
}

impl Reader {
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.at > 0 {
            self.buf.drain(..self.at);
            self.at = 0;
        }
        self.buf.extend_from_slice(chunk);
    }

    /// Whether the trailer has been read: every row came.
    pub fn finished(&self) -> bool {
        self.done
    }

    /// The next whole row, `None` until more bytes come (and after the trailer).
    pub fn next_row(&mut self) -> Result<Option<Fields<'_>>, Error> {
        let corrupt = |detail: &str| Error::Corrupt { what: "COPY stream", detail: detail.to_owned() };
        if self.done {
            return match self.at == self.buf.len() {
                true => Ok(None),
                false => Err(corrupt("bytes after the trailer")),
            };
        }
        if !self.header {
            if self.buf.len() < HEADER.len() {
                return Ok(None);
            }
            if &self.buf[..HEADER.len()] != HEADER {
                return Err(corrupt("not a binary COPY header without OIDs or extension"));
            }
            self.at = HEADER.len();
            self.header = true;
        }
        let rest = &self.buf[self.at..];
        let Some(count) = rest.get(..2) else { return Ok(None) };
        let count = i16::from_be_bytes([count[0], count[1]]);
        if count == -1 {
            self.at += 2;
            self.done = true;
            return Ok(None);
        }
        if count < 0 {
            return Err(corrupt("a negative field count"));
        }
        // The row is whole when every field's length and bytes are here.
        let mut end = 2;
        for _ in 0..count {
            let Some(len) = rest.get(end..end + 4) else { return Ok(None) };
            let len = i32::from_be_bytes([len[0], len[1], len[2], len[3]]);
            end += 4 + usize::try_from(len).unwrap_or(0);
            if end > rest.len() {
                return Ok(None);
            }
        }
        let row = Fields { data: &self.buf[self.at + 2..self.at + end], left: count };
        self.at += end;
        Ok(Some(row))
    }
}

/// The fields of one row, taken in order; a NULL is refused (the statements read have none).
#[derive(Debug)]
pub struct Fields<'a> {
    data: &'a [u8],
    left: i16,
}

impl<'a> Fields<'a> {
    fn field(&mut self, what: &'static str) -> Result<&'a [u8], Error> {
        let corrupt = |detail: &str| Error::Corrupt { what, detail: detail.to_owned() };
        if self.left == 0 {
            return Err(corrupt("missing from its row"));
        }
        self.left -= 1;
        let len = i32::from_be_bytes(self.data[..4].try_into().expect("a whole row"));
        let len = usize::try_from(len).map_err(|_| corrupt("NULL"))?;
        let (field, rest) = self.data[4..].split_at(len);
        self.data = rest;
        Ok(field)
    }

    fn fixed<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], Error> {
        let field = self.field(what)?;
        field
            .try_into()
            .map_err(|_| Error::Corrupt { what, detail: format!("{} bytes, not {N}", field.len()) })
    }

    pub fn i16(&mut self, what: &'static str) -> Result<i16, Error> {
        Ok(i16::from_be_bytes(self.fixed(what)?))
    }
    pub fn i32(&mut self, what: &'static str) -> Result<i32, Error> {
        Ok(i32::from_be_bytes(self.fixed(what)?))
    }
    pub fn i64(&mut self, what: &'static str) -> Result<i64, Error> {
        Ok(i64::from_be_bytes(self.fixed(what)?))
    }
    pub fn uuid(&mut self, what: &'static str) -> Result<Uuid, Error> {
        Ok(Uuid::from_bytes(self.fixed(what)?))
    }
    pub fn text(&mut self, what: &'static str) -> Result<&'a str, Error> {
        std::str::from_utf8(self.field(what)?)
            .map_err(|_| Error::Corrupt { what, detail: "not UTF-8".into() })
    }

    /// A timestamptz as milliseconds since the Unix epoch.
    pub fn timestamptz_ms(&mut self, what: &'static str) -> Result<i64, Error> {
        /// 2000-01-01 UTC, in microseconds since the Unix epoch.
        const EPOCH_2000_US: i64 = 946_684_800_000_000;
        Ok((self.i64(what)?.saturating_add(EPOCH_2000_US)).div_euclid(1_000))
    }

    /// An inet holding one address (a prefix narrower than the address is refused).
    pub fn inet(&mut self, what: &'static str) -> Result<IpAddr, Error> {
        let field = self.field(what)?;
        let corrupt = || Error::Corrupt { what, detail: format!("{field:?} is not one address") };
        match field {
            [PGSQL_AF_INET, 32, _, 4, a @ ..] => {
                let octets: [u8; 4] = a.try_into().map_err(|_| corrupt())?;
                Ok(IpAddr::from(octets))
            }
            [PGSQL_AF_INET6, 128, _, 16, a @ ..] => {
                let octets: [u8; 16] = a.try_into().map_err(|_| corrupt())?;
                Ok(IpAddr::from(octets))
            }
            _ => Err(corrupt()),
        }
    }

    /// Whether every field was taken.
    pub fn exhausted(&self) -> bool {
        self.left == 0
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn written(rows: &[(i16, i64, Uuid, String, IpAddr, i64)]) -> Vec<u8> {
        let mut out = Rows::with_capacity(64);
        for (a, b, c, d, e, f) in rows {
            out.row(6);
            out.i16(*a);
            out.i64(*b);
            out.uuid(*c);
            out.text(d);
            out.inet(*e);
            out.timestamptz(DateTime::from_timestamp_millis(*f).unwrap()).unwrap();
        }
        out.finish()
    }

    proptest! {
        /// What the writer writes, the reader reads back, however the bytes are cut into chunks.
        #[test]
        fn reader_reads_what_the_writer_wrote(
            rows in proptest::collection::vec(
                (any::<i16>(), any::<i64>(), any::<u128>(), "\\PC{0,12}", any::<[u8; 16]>(), any::<bool>(),
                 -1_000_000_000_000i64..10_000_000_000_000),
                0..20,
            ),
            cuts in proptest::collection::vec(1usize..64, 1..8),
        ) {
            let rows: Vec<(i16, i64, Uuid, String, IpAddr, i64)> = rows
                .into_iter()
                .map(|(a, b, c, d, bytes, v4, f)| {
                    let addr = if v4 {
                        IpAddr::from(<[u8; 4]>::try_from(&bytes[..4]).unwrap())
                    } else {
                        IpAddr::from(bytes)
                    };
                    (a, b, Uuid::from_u128(c), d, addr, f)
                })
                .collect();
            let bytes = written(&rows);
            let mut reader = Reader::default();
            let mut read = Vec::new();
            let (mut at, mut cut) = (0, 0);
            while at < bytes.len() {
                let end = (at + cuts[cut % cuts.len()]).min(bytes.len());
                reader.feed(&bytes[at..end]);
                (at, cut) = (end, cut + 1);
                while let Some(mut f) = reader.next_row().unwrap() {
                    let row = (
                        f.i16("a").unwrap(),
                        f.i64("b").unwrap(),
                        f.uuid("c").unwrap(),
                        f.text("d").unwrap().to_owned(),
                        f.inet("e").unwrap(),
                        f.timestamptz_ms("f").unwrap(),
                    );
                    prop_assert!(f.exhausted());
                    read.push(row);
                }
            }
            prop_assert!(reader.finished());
            prop_assert_eq!(read, rows);
        }
    }

    #[test]
    fn a_bad_stream_is_corrupt_not_a_panic() {
        let mut reader = Reader::default();
        reader.feed(b"PGCOPY\n\xff\r\n\0\0\0\0\x01\0\0\0\0");
        assert!(reader.next_row().is_err(), "a header with OIDs");
        let mut bytes = written(&[(1, 2, Uuid::nil(), "x".into(), IpAddr::from([10, 0, 0, 1]), 0)]);
        let mut reader = Reader::default();
        reader.feed(&bytes);
        let mut row = reader.next_row().unwrap().unwrap();
        assert!(row.i64("a").is_err(), "an i16 read as an i64");
        // A NULL, a field too many, bytes after the trailer.
        let mut reader = Reader::default();
        reader.feed(&bytes[..HEADER.len()]);
        reader.feed(&[0, 1, 0xff, 0xff, 0xff, 0xff]);
        assert!(reader.next_row().unwrap().unwrap().i16("null").is_err());
        let mut reader = Reader::default();
        reader.feed(&bytes);
        let mut row = reader.next_row().unwrap().unwrap();
        for _ in 0..6 {
            row.field("any").unwrap();
        }
        assert!(row.field("seventh").is_err());
        bytes.push(0);
        let mut reader = Reader::default();
        reader.feed(&bytes);
        assert!(reader.next_row().unwrap().is_some());
        assert!(reader.next_row().unwrap().is_none() && reader.finished());
        assert!(reader.next_row().is_err(), "a byte after the trailer");
    }
}
