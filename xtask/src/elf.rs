//! Just enough ELF64 little-endian parsing to check a BPF object: machine and section names.

use anyhow::{Context, Result, bail, ensure};

/// `e_machine` of eBPF objects.
pub const EM_BPF: u16 = 247;

const MAGIC: &[u8; 4] = b"\x7fELF";
const ELFCLASS64: u8 = 2;
const ELFDATA2LSB: u8 = 1;
const EHDR_LEN: usize = 64;
const SHDR_LEN: usize = 64;

/// What the checks need from an object file.
#[derive(Debug, PartialEq, Eq)]
pub struct Elf {
    pub machine: u16,
    /// Section names in header order, without the null section.
    pub sections: Vec<String>,
}

pub fn parse(bytes: &[u8]) -> Result<Elf> {
    ensure!(
        bytes.len() >= EHDR_LEN && bytes.starts_with(MAGIC),
        "not an ELF file ({} bytes, no \\x7fELF header)",
        bytes.len()
    );
    ensure!(bytes[4] == ELFCLASS64, "ELF class is {}, expected 2 (64-bit)", bytes[4]);
    ensure!(bytes[5] == ELFDATA2LSB, "ELF data encoding is {}, expected 1 (little-endian)", bytes[5]);
    let machine = u16_at(bytes, 18)?;
    let shoff = usize_at(bytes, 0x28)?;
    let shentsize = usize::from(u16_at(bytes, 0x3a)?);
    let shnum = usize::from(u16_at(bytes, 0x3c)?);
    let shstrndx = usize::from(u16_at(bytes, 0x3e)?);
    ensure!(shentsize == SHDR_LEN, "section header size is {shentsize}, expected {SHDR_LEN}");
    ensure!(shnum > 0, "no section headers (or more than 65279, which is unsupported)");
    ensure!(shstrndx < shnum, "section name table index {shstrndx} is out of range (< {shnum})");

    let header = |index: usize| -> Result<&[u8]> {
        let start = index.checked_mul(SHDR_LEN).and_then(|relative| relative.checked_add(shoff));
        start
            .and_then(|start| bytes.get(start..start.checked_add(SHDR_LEN)?))
            .with_context(|| format!("section header {index} (table at {shoff}) is past the end of the file"))
    };
    let names = section_data(header(shstrndx)?, bytes).context("reading the section name table")?;
    let sections = (1..shnum)
        .map(|index| {
            let name_offset = usize::try_from(u32_at(header(index)?, 0)?)?;
            c_str_at(names, name_offset).with_context(|| format!("name of section {index}"))
        })
        .collect::<Result<_>>()?;
    Ok(Elf { machine, sections })
}

fn section_data<'a>(header: &[u8], bytes: &'a [u8]) -> Result<&'a [u8]> {
    let offset = usize_at(header, 0x18)?;
    let size = usize_at(header, 0x20)?;
    offset
        .checked_add(size)
        .and_then(|end| bytes.get(offset..end))
        .with_context(|| format!("section data {offset}+{size} is past the end of the file"))
}

fn c_str_at(table: &[u8], offset: usize) -> Result<String> {
    let rest =
        table.get(offset..).with_context(|| format!("name offset {offset} is outside the name table"))?;
    let len = rest
        .iter()
        .position(|&b| b == 0)
        .with_context(|| format!("name at {offset} is not NUL-terminated"))?;
    Ok(String::from_utf8_lossy(&rest[..len]).into_owned())
}

fn bytes_at<const N: usize>(bytes: &[u8], offset: usize) -> Result<[u8; N]> {
    match bytes.get(offset..offset + N) {
        Some(slice) => Ok(slice.try_into()?),
        None => bail!("field at {offset} is past the end ({} bytes)", bytes.len()),
    }
}

fn u16_at(bytes: &[u8], offset: usize) -> Result<u16> {
    bytes_at(bytes, offset).map(u16::from_le_bytes)
}

fn u32_at(bytes: &[u8], offset: usize) -> Result<u32> {
    bytes_at(bytes, offset).map(u32::from_le_bytes)
}

fn usize_at(bytes: &[u8], offset: usize) -> Result<usize> {
    let value = bytes_at(bytes, offset).map(u64::from_le_bytes)?;
    usize::try_from(value).with_context(|| format!("offset {value} does not fit in memory"))
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A minimal ELF64 object: header, then the name table, then section headers for the
    /// null section, the named sections (empty) and `.shstrtab` last.
    pub fn tiny_elf(machine: u16, names: &[&str]) -> Vec<u8> {
        let mut strtab = vec![0u8];
        let mut name_offsets = Vec::new();
        for name in names.iter().chain([&".shstrtab"]) {
            name_offsets.push(u32::try_from(strtab.len()).unwrap());
            strtab.extend_from_slice(name.as_bytes());
            strtab.push(0);
        }
        let shnum = names.len() + 2;
        let shoff = EHDR_LEN + strtab.len();

        let mut elf = vec![0u8; EHDR_LEN];
        elf[..4].copy_from_slice(MAGIC);
        elf[4] = ELFCLASS64;
        elf[5] = ELFDATA2LSB;
        elf[6] = 1;
        elf[16..18].copy_from_slice(&1u16.to_le_bytes()); // ET_REL
        elf[18..20].copy_from_slice(&machine.to_le_bytes());
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x34..0x36].copy_from_slice(&(EHDR_LEN as u16).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&(SHDR_LEN as u16).to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&(shnum as u16).to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&((shnum - 1) as u16).to_le_bytes());
        elf.extend_from_slice(&strtab);

        elf.extend_from_slice(&[0u8; SHDR_LEN]);
        for (index, name_offset) in name_offsets.iter().enumerate() {
            let mut header = [0u8; SHDR_LEN];
            header[..4].copy_from_slice(&name_offset.to_le_bytes());
            if index == names.len() {
                header[4..8].copy_from_slice(&3u32.to_le_bytes()); // SHT_STRTAB
                header[0x18..0x20].copy_from_slice(&(EHDR_LEN as u64).to_le_bytes());
                header[0x20..0x28].copy_from_slice(&(strtab.len() as u64).to_le_bytes());
            }
            elf.extend_from_slice(&header);
        }
        elf
    }

    fn error(bytes: &[u8]) -> String {
        format!("{:#}", parse(bytes).unwrap_err())
    }

    #[test]
    fn reads_machine_and_section_names_in_order() {
        let elf = parse(&tiny_elf(EM_BPF, &["classifier", ".maps", ".BTF"])).unwrap();
        assert_eq!(
            elf,
            Elf {
                machine: EM_BPF,
                sections: vec!["classifier".into(), ".maps".into(), ".BTF".into(), ".shstrtab".into()],
            }
        );
    }

    #[test]
    fn rejects_non_elf_and_wrong_layouts() {
        assert_eq!(error(b"#!/bin/sh\n"), "not an ELF file (10 bytes, no \\x7fELF header)");
        let mut elf = tiny_elf(EM_BPF, &[]);
        elf[4] = 1;
        assert_eq!(error(&elf), "ELF class is 1, expected 2 (64-bit)");
        let mut elf = tiny_elf(EM_BPF, &[]);
        elf[5] = 2;
        assert_eq!(error(&elf), "ELF data encoding is 2, expected 1 (little-endian)");
    }

    #[test]
    fn rejects_truncated_files_and_bad_offsets() {
        let elf = tiny_elf(EM_BPF, &["classifier"]);
        let truncated = &elf[..elf.len() - 10];
        assert_eq!(error(truncated), "section header 2 (table at 86) is past the end of the file");

        let mut elf = tiny_elf(EM_BPF, &["classifier"]);
        let first_named = elf.len() - 2 * SHDR_LEN;
        elf[first_named..first_named + 4].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(error(&elf), "name of section 1: name offset 1000 is outside the name table");
    }
}
