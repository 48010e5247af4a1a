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
