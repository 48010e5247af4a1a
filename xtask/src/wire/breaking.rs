//! The comparison behind `cargo xtask check-wire`, pure: every change between a released
//! descriptor set and the current one that a peer built from the released contract would
//! trip over.
//!
//! Messages, enums and services are matched by their full name across files (moving a type
//! to another file of the same package breaks nothing), fields, enum values and rpcs by name
//! within them. Breaking: a removed package, message, enum, service or rpc (a rename is a
//! removal); a removed field or enum value whose number is not reserved now; a field whose
//! number, type or label (repeated, optional, member of which oneof) changed; an enum value
//! whose number changed; an rpc whose request or response type or streaming changed; a number
//! that was reserved and is not any more (it could be reused with another meaning). Additions
//! are allowed. Files under `google/protobuf/` belong to protoc, not to the contract.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
};

use prost_types::{
    DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorProto, FileDescriptorSet,
    ServiceDescriptorProto,
    field_descriptor_proto::{Label, Type},
};

/// One breaking change: the file it is in (the current file when the element still exists,
/// the released one when it is gone), the full name of the element and what happened to it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Break {
    pub file: String,
    pub path: String,
    pub what: String,
}

impl fmt::Display for Break {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.file, self.path, self.what)
    }
}

/// Every breaking change from `released` to `current`, sorted by file and path.
pub fn breaking_changes(released: &FileDescriptorSet, current: &FileDescriptorSet) -> Vec<Break> {
    let old = Index::of(released);
    let new = Index::of(current);
    let mut breaks = Vec::new();

    // A package that is gone takes every type in it along; one line says so, not hundreds.
    let mut gone = BTreeSet::new();
    for (package, file) in &old.packages {
        if !new.packages.contains_key(package) {
            let now = new.packages.keys().map(|p| format!("`{p}`")).collect::<Vec<_>>().join(", ");
            breaks.push(Break {
                file: file.clone(),
                path: package.clone(),
                what: format!("package was removed or renamed (the protos now declare {now})"),
            });
            gone.insert(package.as_str());
        }
    }
    let kept = |package: &str| !gone.contains(package);

    for (name, was) in old.messages.iter().filter(|(_, item)| kept(item.package)) {
        match new.messages.get(name) {
            None => breaks.push(removed(was.file, name, "message")),
            Some(now) => compare_message(name, was.proto, now, &mut breaks),
        }
    }
    for (name, was) in old.enums.iter().filter(|(_, item)| kept(item.package)) {
        match new.enums.get(name) {
            None => breaks.push(removed(was.file, name, "enum")),
            Some(now) => compare_enum(name, was.proto, now, &mut breaks),
        }
    }
    for (name, was) in old.services.iter().filter(|(_, item)| kept(item.package)) {
        match new.services.get(name) {
            None => breaks.push(removed(was.file, name, "service")),
            Some(now) => compare_service(name, was.proto, now, &mut breaks),
        }
    }
    breaks.sort();
    breaks
}

fn removed(file: &str, path: &str, kind: &str) -> Break {
    Break { file: file.to_owned(), path: path.to_owned(), what: format!("{kind} was removed or renamed") }
}

/// A message, enum or service with the file and package it is declared in.
#[derive(Debug)]
struct Item<'a, T> {
    file: &'a str,
    package: &'a str,
    proto: &'a T,
}

/// The contract's types by full name (without the leading dot), nested ones included.
#[derive(Debug, Default)]
struct Index<'a> {
    /// Each package with the first file that declares it.
    packages: BTreeMap<String, String>,
    messages: BTreeMap<String, Item<'a, DescriptorProto>>,
    enums: BTreeMap<String, Item<'a, EnumDescriptorProto>>,
    services: BTreeMap<String, Item<'a, ServiceDescriptorProto>>,
}

impl<'a> Index<'a> {
    fn of(set: &'a FileDescriptorSet) -> Self {
        let mut index = Index::default();
        for file in set.file.iter().filter(|file| !file.name().starts_with("google/protobuf/")) {
            index.add_file(file);
        }
        index
    }

    fn add_file(&mut self, file: &'a FileDescriptorProto) {
        let (name, package) = (file.name(), file.package());
        self.packages.entry(package.to_owned()).or_insert_with(|| name.to_owned());
        for message in &file.message_type {
            self.add_message(name, package, package, message);
        }
        for proto in &file.enum_type {
            self.enums.insert(qualify(package, proto.name()), Item { file: name, package, proto });
        }
        for proto in &file.service {
            self.services.insert(qualify(package, proto.name()), Item { file: name, package, proto });
        }
    }

    fn add_message(&mut self, file: &'a str, package: &'a str, scope: &str, proto: &'a DescriptorProto) {
        let full = qualify(scope, proto.name());
        for nested in &proto.nested_type {
            self.add_message(file, package, &full, nested);
        }
        for nested in &proto.enum_type {
            self.enums.insert(qualify(&full, nested.name()), Item { file, package, proto: nested });
        }
        self.messages.insert(full, Item { file, package, proto });
    }
}

fn qualify(scope: &str, name: &str) -> String {
    if scope.is_empty() { name.to_owned() } else { format!("{scope}.{name}") }
}

fn compare_message(
    name: &str,
    old: &DescriptorProto,
    now: &Item<'_, DescriptorProto>,
    breaks: &mut Vec<Break>,
) {
    let new = now.proto;
    let at = |path: String, what: String| Break { file: now.file.to_owned(), path, what };
    let new_fields: BTreeMap<&str, &FieldDescriptorProto> = new.field.iter().map(|f| (f.name(), f)).collect();
    // A message's reserved ranges end before `end`.
    let cover: Vec<(i64, i64)> =
        new.reserved_range.iter().map(|r| (i64::from(r.start()), i64::from(r.end()))).collect();
    let reserved = |number: i32| !is_free(i64::from(number), &cover);
    for field in &old.field {
        let path = format!("{name}.{}", field.name());
        let Some(current) = new_fields.get(field.name()) else {
            let number = field.number();
            if !reserved(number) {
                let reuse = match new.field.iter().find(|f| f.number() == number) {
                    Some(other) => format!(" (number {number} now belongs to `{}`)", other.name()),
                    None => String::new(),
                };
                breaks.push(at(
                    path,
                    format!("field {number} was removed or renamed without `reserved {number};`{reuse}"),
                ));
            }
            continue;
        };
        if field.number() != current.number() {
            breaks.push(at(
                path.clone(),
                format!("field number changed from {} to {}", field.number(), current.number()),
            ));
        }
        let (was_type, now_type) = (type_of(field), type_of(current));
        if was_type != now_type {
            breaks.push(at(path.clone(), format!("type changed from {was_type} to {now_type}")));
        }
        let (was_label, now_label) = (label_of(old, field), label_of(new, current));
        if was_label != now_label {
            breaks.push(at(path, format!("label changed from {was_label} to {now_label}")));
        }
    }

    for range in &old.reserved_range {
        let free = uncovered(i64::from(range.start()), i64::from(range.end()), &cover);
        if !free.is_empty() {
            breaks.push(at(name.to_owned(), format!("field numbers no longer reserved: {}", spans(&free))));
        }
    }
}

fn compare_enum(
    name: &str,
    old: &EnumDescriptorProto,
    now: &Item<'_, EnumDescriptorProto>,
    breaks: &mut Vec<Break>,
) {
    let new = now.proto;
    let at = |path: String, what: String| Break { file: now.file.to_owned(), path, what };
    let new_values: BTreeMap<&str, i32> = new.value.iter().map(|v| (v.name(), v.number())).collect();
    // An enum's reserved ranges include `end`.
    let half_open = |start: i32, end: i32| (i64::from(start), i64::from(end) + 1);
    let cover: Vec<(i64, i64)> = new.reserved_range.iter().map(|r| half_open(r.start(), r.end())).collect();
    let reserved = |number: i32| !is_free(i64::from(number), &cover);
    for value in &old.value {
        let path = format!("{name}.{}", value.name());
        match new_values.get(value.name()) {
            None if reserved(value.number()) => {}
            None => {
                let number = value.number();
                breaks.push(at(
                    path,
                    format!("value {number} was removed or renamed without `reserved {number};`"),
                ));
            }
            Some(&number) if number != value.number() => {
                breaks.push(at(path, format!("value number changed from {} to {number}", value.number())));
            }
            Some(_) => {}
        }
    }

    for range in &old.reserved_range {
        let (start, end) = half_open(range.start(), range.end());
        let free = uncovered(start, end, &cover);
        if !free.is_empty() {
            breaks.push(at(name.to_owned(), format!("value numbers no longer reserved: {}", spans(&free))));
        }
    }
}

fn compare_service(
    name: &str,
    old: &ServiceDescriptorProto,
    now: &Item<'_, ServiceDescriptorProto>,
    breaks: &mut Vec<Break>,
) {
    let at = |path: String, what: String| Break { file: now.file.to_owned(), path, what };
    for rpc in &old.method {
        let path = format!("{name}.{}", rpc.name());
        let Some(current) = now.proto.method.iter().find(|m| m.name() == rpc.name()) else {
            breaks.push(at(path, "rpc was removed or renamed".to_owned()));
            continue;
        };
        let sides = [
            (
                "request",
                rpc.input_type(),
                current.input_type(),
                rpc.client_streaming(),
                current.client_streaming(),
            ),
            (
                "response",
                rpc.output_type(),
                current.output_type(),
                rpc.server_streaming(),
                current.server_streaming(),
            ),
        ];
        for (side, was_type, now_type, was_stream, now_stream) in sides {
            if was_type != now_type {
                breaks.push(at(
                    path.clone(),
                    format!(
                        "{side} type changed from {} to {}",
                        was_type.trim_start_matches('.'),
                        now_type.trim_start_matches('.')
                    ),
                ));
            }
            if was_stream != now_stream {
                let shape = |stream: bool| if stream { "a stream" } else { "a single message" };
                breaks.push(at(
                    path.clone(),
                    format!("{side} changed from {} to {}", shape(was_stream), shape(now_stream)),
                ));
            }
        }
    }
}

/// A field's type as a `.proto` file spells it: a scalar keyword, or the full name of its
/// message or enum.
fn type_of(field: &FieldDescriptorProto) -> String {
    let scalar = match field.r#type() {
        Type::Message | Type::Enum | Type::Group => {
            return field.type_name().trim_start_matches('.').to_owned();
        }
        Type::Double => "double",
        Type::Float => "float",
        Type::Int64 => "int64",
        Type::Uint64 => "uint64",
        Type::Int32 => "int32",
        Type::Fixed64 => "fixed64",
        Type::Fixed32 => "fixed32",
        Type::Bool => "bool",
        Type::String => "string",
        Type::Bytes => "bytes",
        Type::Uint32 => "uint32",
        Type::Sfixed32 => "sfixed32",
        Type::Sfixed64 => "sfixed64",
        Type::Sint32 => "sint32",
        Type::Sint64 => "sint64",
    };
    scalar.to_owned()
}

/// A field's label: repeated, required, optional (explicit presence), a member of a named
/// oneof, or singular.
fn label_of(message: &DescriptorProto, field: &FieldDescriptorProto) -> String {
    match field.label() {
        Label::Repeated => "repeated".to_owned(),
        Label::Required => "required".to_owned(),
        // proto3 `optional` is a synthetic oneof of one field: it is presence, not a oneof.
        Label::Optional if field.proto3_optional() => "optional".to_owned(),
        Label::Optional => match field.oneof_index {
            Some(index) => {
                let oneof = usize::try_from(index).ok().and_then(|i| message.oneof_decl.get(i));
                format!("oneof `{}`", oneof.map_or("?", |o| o.name()))
            }
            None => "singular".to_owned(),
        },
    }
}

fn is_free(number: i64, cover: &[(i64, i64)]) -> bool {
    !uncovered(number, number + 1, cover).is_empty()
}

/// The parts of `[start, end)` that no range `[from, to)` of `cover` contains. Ranges are
/// walked, never their numbers: `reserved 10 to max;` spans half a billion of them.
fn uncovered(start: i64, end: i64, cover: &[(i64, i64)]) -> Vec<(i64, i64)> {
    let mut cover = cover.to_vec();
    cover.sort_unstable();
    let mut free = Vec::new();
    let mut at = start;
    for (from, to) in cover {
        if at >= end || from >= end {
            break;
        }
        if from > at {
            free.push((at, from));
        }
        at = at.max(to);
    }
    if at < end {
        free.push((at, end));
    }
    free
}

/// Half-open ranges as a reader writes them: `2, 5 to 9`.
fn spans(ranges: &[(i64, i64)]) -> String {
    let span = |&(start, end): &(i64, i64)| {
        if end - start == 1 { start.to_string() } else { format!("{start} to {}", end - 1) }
    };
    ranges.iter().map(span).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use prost_types::{
        EnumValueDescriptorProto, MethodDescriptorProto, OneofDescriptorProto,
        descriptor_proto::ReservedRange, enum_descriptor_proto::EnumReservedRange,
    };

    use super::*;

    /// The breaks from `old` to `new`, one line each.
    fn check(old: Vec<FileDescriptorProto>, new: Vec<FileDescriptorProto>, expected: &[&str]) {
        let old = FileDescriptorSet { file: old };
        let new = FileDescriptorSet { file: new };
        let found: Vec<String> = breaking_changes(&old, &new).iter().map(ToString::to_string).collect();
        assert_eq!(found, expected);
    }

    fn file(name: &str, messages: Vec<DescriptorProto>) -> FileDescriptorProto {
        FileDescriptorProto {
            name: Some(name.to_owned()),
            package: Some("innerwall.agent.v1".to_owned()),
            message_type: messages,
            syntax: Some("proto3".to_owned()),
            ..Default::default()
        }
    }

    fn message(name: &str, fields: Vec<FieldDescriptorProto>) -> DescriptorProto {
        DescriptorProto { name: Some(name.to_owned()), field: fields, ..Default::default() }
    }

    fn field(name: &str, number: i32, ty: Type) -> FieldDescriptorProto {
        FieldDescriptorProto {
            name: Some(name.to_owned()),
            number: Some(number),
            label: Some(Label::Optional as i32),
            r#type: Some(ty as i32),
            ..Default::default()
        }
    }

    fn typed(name: &str, number: i32, ty: Type, type_name: &str) -> FieldDescriptorProto {
        FieldDescriptorProto { type_name: Some(type_name.to_owned()), ..field(name, number, ty) }
    }

    fn reserving(mut message: DescriptorProto, start: i32, end: i32) -> DescriptorProto {
        message.reserved_range.push(ReservedRange { start: Some(start), end: Some(end) });
        message
    }

    fn enumeration(name: &str, values: &[(&str, i32)]) -> EnumDescriptorProto {
        EnumDescriptorProto {
            name: Some(name.to_owned()),
            value: values
                .iter()
                .map(|&(name, number)| EnumValueDescriptorProto {
                    name: Some(name.to_owned()),
                    number: Some(number),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn with_enum(enumeration: EnumDescriptorProto) -> FileDescriptorProto {
        FileDescriptorProto { enum_type: vec![enumeration], ..file("common.proto", vec![]) }
    }

    fn rpc(name: &str, input: &str, output: &str, streams: (bool, bool)) -> MethodDescriptorProto {
        MethodDescriptorProto {
            name: Some(name.to_owned()),
            input_type: Some(format!(".innerwall.agent.v1.{input}")),
            output_type: Some(format!(".innerwall.agent.v1.{output}")),
            client_streaming: Some(streams.0),
            server_streaming: Some(streams.1),
            ..Default::default()
        }
    }

    fn with_service(methods: Vec<MethodDescriptorProto>) -> FileDescriptorProto {
        let service = ServiceDescriptorProto {
            name: Some("AgentService".to_owned()),
            method: methods,
            ..Default::default()
        };
        FileDescriptorProto { service: vec![service], ..file("sync.proto", vec![]) }
    }

    fn flow_record(fields: Vec<FieldDescriptorProto>) -> Vec<FileDescriptorProto> {
        vec![file("telemetry.proto", vec![message("FlowRecord", fields)])]
    }

    fn src_dst() -> Vec<FieldDescriptorProto> {
        vec![field("src_address", 1, Type::String), field("dst_address", 2, Type::String)]
    }

    #[test]
    fn the_same_contract_has_no_break() {
        check(flow_record(src_dst()), flow_record(src_dst()), &[]);
    }

    #[test]
    fn a_removed_field_is_reported() {
        check(
            flow_record(src_dst()),
            flow_record(vec![field("src_address", 1, Type::String)]),
            &["telemetry.proto: innerwall.agent.v1.FlowRecord.dst_address: \
               field 2 was removed or renamed without `reserved 2;`"],
        );
    }

    #[test]
    fn a_removed_field_whose_number_is_reserved_is_not() {
        let new = reserving(message("FlowRecord", vec![field("src_address", 1, Type::String)]), 2, 3);
        check(flow_record(src_dst()), vec![file("telemetry.proto", vec![new])], &[]);
    }

    #[test]
    fn a_renamed_field_is_a_removal_that_names_the_new_owner_of_the_number() {
        check(
            flow_record(src_dst()),
            flow_record(vec![field("src_address", 1, Type::String), field("destination", 2, Type::String)]),
            &["telemetry.proto: innerwall.agent.v1.FlowRecord.dst_address: \
               field 2 was removed or renamed without `reserved 2;` (number 2 now belongs to `destination`)"],
        );
    }

    #[test]
    fn a_changed_field_number_is_reported() {
        check(
            flow_record(src_dst()),
            flow_record(vec![field("src_address", 1, Type::String), field("dst_address", 5, Type::String)]),
            &["telemetry.proto: innerwall.agent.v1.FlowRecord.dst_address: field number changed from 2 to 5"],
        );
    }

    #[test]
    fn a_changed_field_type_is_reported() {
        check(
            flow_record(src_dst()),
            flow_record(vec![field("src_address", 1, Type::Bytes), field("dst_address", 2, Type::String)]),
            &[
                "telemetry.proto: innerwall.agent.v1.FlowRecord.src_address: type changed from string to bytes",
            ],
        );
    }

    #[test]
    fn a_changed_type_name_is_reported() {
        let old = flow_record(vec![typed("protocol", 4, Type::Enum, ".innerwall.agent.v1.Protocol")]);
        let new = flow_record(vec![typed("protocol", 4, Type::Enum, ".innerwall.agent.v1.IpProtocol")]);
        check(
            old,
            new,
            &["telemetry.proto: innerwall.agent.v1.FlowRecord.protocol: \
               type changed from innerwall.agent.v1.Protocol to innerwall.agent.v1.IpProtocol"],
        );
    }

    #[test]
    fn a_changed_label_is_reported() {
        let repeated =
            FieldDescriptorProto { label: Some(Label::Repeated as i32), ..field("a", 1, Type::String) };
        let optional = FieldDescriptorProto { proto3_optional: Some(true), ..field("b", 2, Type::String) };
        let in_oneof = FieldDescriptorProto { oneof_index: Some(0), ..field("c", 3, Type::String) };
        let mut new = message("M", vec![repeated, optional, in_oneof]);
        new.oneof_decl.push(OneofDescriptorProto { name: Some("change".to_owned()), ..Default::default() });
        let old = message(
            "M",
            vec![field("a", 1, Type::String), field("b", 2, Type::String), field("c", 3, Type::String)],
        );
        check(
            vec![file("policy.proto", vec![old])],
            vec![file("policy.proto", vec![new])],
            &[
                "policy.proto: innerwall.agent.v1.M.a: label changed from singular to repeated",
                "policy.proto: innerwall.agent.v1.M.b: label changed from singular to optional",
                "policy.proto: innerwall.agent.v1.M.c: label changed from singular to oneof `change`",
            ],
        );
    }

    #[test]
    fn an_added_field_or_message_is_not_reported() {
        let mut new = flow_record([src_dst(), vec![field("dst_port", 3, Type::Uint32)]].concat());
        new[0].message_type.push(message("FlowSummary", vec![field("flows", 1, Type::Uint64)]));
        new.push(with_enum(enumeration("Verdict", &[("VERDICT_UNSPECIFIED", 0)])));
        check(flow_record(src_dst()), new, &[]);
    }

    #[test]
    fn a_type_moved_to_another_file_of_the_package_is_not_reported() {
        let record = message("FlowRecord", src_dst());
        check(
            vec![file("telemetry.proto", vec![record.clone()])],
            vec![file("telemetry.proto", vec![]), file("flows.proto", vec![record])],
            &[],
        );
    }

    #[test]
    fn a_removed_field_of_a_nested_message_is_reported_with_its_path() {
        let outer =
            |inner: DescriptorProto| DescriptorProto { nested_type: vec![inner], ..message("Outer", vec![]) };
        check(
            vec![file("policy.proto", vec![outer(message("Inner", src_dst()))])],
            vec![file(
                "policy.proto",
                vec![outer(message("Inner", vec![field("src_address", 1, Type::String)]))],
            )],
            &["policy.proto: innerwall.agent.v1.Outer.Inner.dst_address: \
               field 2 was removed or renamed without `reserved 2;`"],
        );
    }

    #[test]
    fn an_unreserved_field_number_is_reported() {
        let old = reserving(message("FlowRecord", vec![field("src_address", 1, Type::String)]), 2, 4);
        let new = reserving(
            message(
                "FlowRecord",
                vec![field("src_address", 1, Type::String), field("dst_address", 2, Type::Bytes)],
            ),
            3,
            4,
        );
        check(
            vec![file("telemetry.proto", vec![old])],
            vec![file("telemetry.proto", vec![new])],
            &["telemetry.proto: innerwall.agent.v1.FlowRecord: field numbers no longer reserved: 2"],
        );
    }

    #[test]
    fn a_removed_message_is_reported() {
        check(
            vec![file(
                "telemetry.proto",
                vec![message("FlowRecord", src_dst()), message("EvidenceGap", vec![])],
            )],
            vec![file("telemetry.proto", vec![message("FlowRecord", src_dst())])],
            &["telemetry.proto: innerwall.agent.v1.EvidenceGap: message was removed or renamed"],
        );
    }

    #[test]
    fn a_removed_enum_value_is_reported() {
        let old =
            enumeration("Protocol", &[("PROTOCOL_UNSPECIFIED", 0), ("PROTOCOL_TCP", 1), ("PROTOCOL_UDP", 2)]);
        let new = enumeration("Protocol", &[("PROTOCOL_UNSPECIFIED", 0), ("PROTOCOL_TCP", 1)]);
        check(
            vec![with_enum(old)],
            vec![with_enum(new)],
            &["common.proto: innerwall.agent.v1.Protocol.PROTOCOL_UDP: \
               value 2 was removed or renamed without `reserved 2;`"],
        );
    }

    #[test]
    fn a_removed_enum_value_whose_number_is_reserved_is_not() {
        let old =
            enumeration("Protocol", &[("PROTOCOL_UNSPECIFIED", 0), ("PROTOCOL_TCP", 1), ("PROTOCOL_UDP", 2)]);
        let mut new = enumeration("Protocol", &[("PROTOCOL_UNSPECIFIED", 0), ("PROTOCOL_TCP", 1)]);
        // Inclusive: `reserved 2;` in an enum is the range 2..=2.
        new.reserved_range.push(EnumReservedRange { start: Some(2), end: Some(2) });
        check(vec![with_enum(old)], vec![with_enum(new)], &[]);
    }

    #[test]
    fn a_changed_enum_value_number_and_an_unreserved_one_are_reported() {
        let mut old = enumeration("Protocol", &[("PROTOCOL_UNSPECIFIED", 0), ("PROTOCOL_TCP", 1)]);
        old.reserved_range.push(EnumReservedRange { start: Some(5), end: Some(i32::MAX) });
        let mut new = enumeration("Protocol", &[("PROTOCOL_UNSPECIFIED", 0), ("PROTOCOL_TCP", 6)]);
        new.reserved_range.push(EnumReservedRange { start: Some(7), end: Some(i32::MAX) });
        check(
            vec![with_enum(old)],
            vec![with_enum(new)],
            &[
                "common.proto: innerwall.agent.v1.Protocol: value numbers no longer reserved: 5 to 6",
                "common.proto: innerwall.agent.v1.Protocol.PROTOCOL_TCP: value number changed from 1 to 6",
            ],
        );
    }

    #[test]
    fn a_removed_enum_is_reported() {
        check(
            vec![with_enum(enumeration("Protocol", &[("PROTOCOL_UNSPECIFIED", 0)]))],
            vec![file("common.proto", vec![])],
            &["common.proto: innerwall.agent.v1.Protocol: enum was removed or renamed"],
        );
    }

    #[test]
    fn a_removed_or_changed_rpc_is_reported() {
        let old = with_service(vec![
            rpc("Sync", "SyncRequest", "SyncResponse", (true, true)),
            rpc("RenewCredential", "RenewCredentialRequest", "RenewCredentialResponse", (false, false)),
            rpc("Ping", "PingRequest", "PingResponse", (false, false)),
        ]);
        let new = with_service(vec![
            rpc("Sync", "SyncRequest", "SyncResponse", (true, false)),
            rpc("RenewCredential", "RenewRequest", "RenewCredentialResponse", (false, false)),
        ]);
        check(
            vec![old],
            vec![new],
            &[
                "sync.proto: innerwall.agent.v1.AgentService.Ping: rpc was removed or renamed",
                "sync.proto: innerwall.agent.v1.AgentService.RenewCredential: \
                 request type changed from innerwall.agent.v1.RenewCredentialRequest \
                 to innerwall.agent.v1.RenewRequest",
                "sync.proto: innerwall.agent.v1.AgentService.Sync: \
                 response changed from a stream to a single message",
            ],
        );
    }

    #[test]
    fn a_removed_service_is_reported() {
        check(
            vec![with_service(vec![])],
            vec![file("sync.proto", vec![])],
            &["sync.proto: innerwall.agent.v1.AgentService: service was removed or renamed"],
        );
    }

    #[test]
    fn a_renamed_package_is_reported_once() {
        let renamed = |mut file: FileDescriptorProto| {
            file.package = Some("innerwall.agent.v2".to_owned());
            file
        };
        check(
            flow_record(src_dst()),
            flow_record(src_dst()).into_iter().map(renamed).collect(),
            &["telemetry.proto: innerwall.agent.v1: \
               package was removed or renamed (the protos now declare `innerwall.agent.v2`)"],
        );
    }

    #[test]
    fn uncovered_walks_ranges() {
        assert_eq!(uncovered(2, 10, &[]), [(2, 10)]);
        assert_eq!(uncovered(2, 10, &[(5, 6), (0, 3), (8, 20)]), [(3, 5), (6, 8)]);
        assert_eq!(uncovered(2, 10, &[(0, 5), (5, 10)]), []);
        assert_eq!(spans(&[(3, 5), (6, 7)]), "3 to 4, 6");
        // `reserved 10 to max;` in a message, answered at once.
        assert!(uncovered(10, 536_870_912, &[(10, 536_870_912)]).is_empty());
    }
}
