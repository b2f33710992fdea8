//! Numbers from `linux/netlink.h`, `linux/netfilter/nfnetlink.h` and `linux/netfilter/nf_tables.h`
//! (and the few libnftnl/nft user-data conventions) that the encoder and decoder share. Kept as plain
//! constants, named as in the kernel headers, so each can be checked against the header by grep.
#![allow(dead_code)]

// netlink.h
pub const NLMSG_HDRLEN: usize = 16;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_MULTI: u16 = 0x2;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLM_F_REPLACE: u16 = 0x100;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_F_NET_BYTEORDER: u16 = 0x4000;
pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

// nfnetlink.h
pub const NFNL_SUBSYS_NFTABLES: u8 = 10;
pub const NFNL_MSG_BATCH_BEGIN: u16 = 16;
pub const NFNL_MSG_BATCH_END: u16 = 17;
pub const NFNETLINK_V0: u8 = 0;
/// Attribute of BATCH_BEGIN: the ruleset generation the batch was computed on (ERESTART if not).
pub const NFNL_BATCH_GENID: u16 = 1;

pub const NFPROTO_UNSPEC: u8 = 0;
pub const NFPROTO_INET: u8 = 1;

// enum nf_tables_msg_types
pub const NFT_MSG_NEWTABLE: u8 = 0;
pub const NFT_MSG_GETTABLE: u8 = 1;
pub const NFT_MSG_DELTABLE: u8 = 2;
pub const NFT_MSG_NEWCHAIN: u8 = 3;
pub const NFT_MSG_GETCHAIN: u8 = 4;
pub const NFT_MSG_DELCHAIN: u8 = 5;
pub const NFT_MSG_NEWRULE: u8 = 6;
pub const NFT_MSG_GETRULE: u8 = 7;
pub const NFT_MSG_DELRULE: u8 = 8;
pub const NFT_MSG_NEWSET: u8 = 9;
pub const NFT_MSG_GETSET: u8 = 10;
pub const NFT_MSG_DELSET: u8 = 11;
pub const NFT_MSG_NEWSETELEM: u8 = 12;
pub const NFT_MSG_GETSETELEM: u8 = 13;
pub const NFT_MSG_DELSETELEM: u8 = 14;
pub const NFT_MSG_NEWGEN: u8 = 15;
pub const NFT_MSG_GETGEN: u8 = 16;
pub const NFT_MSG_NEWOBJ: u8 = 18;
pub const NFT_MSG_GETOBJ: u8 = 19;
pub const NFT_MSG_DELOBJ: u8 = 20;

// table
pub const NFTA_TABLE_NAME: u16 = 1;
pub const NFTA_TABLE_FLAGS: u16 = 2;
/// How many chains the table holds, says the header; 6.18 counts its named sets, objects and
/// flowtables too (not the anonymous sets).
pub const NFTA_TABLE_USE: u16 = 3;
// chain
pub const NFTA_CHAIN_TABLE: u16 = 1;
pub const NFTA_CHAIN_HANDLE: u16 = 2;
pub const NFTA_CHAIN_NAME: u16 = 3;
pub const NFTA_CHAIN_HOOK: u16 = 4;
pub const NFTA_CHAIN_POLICY: u16 = 5;
pub const NFTA_CHAIN_TYPE: u16 = 7;
pub const NFTA_CHAIN_USERDATA: u16 = 12;
pub const NFTA_HOOK_HOOKNUM: u16 = 1;
pub const NFTA_HOOK_PRIORITY: u16 = 2;
// rule
pub const NFTA_RULE_TABLE: u16 = 1;
pub const NFTA_RULE_CHAIN: u16 = 2;
pub const NFTA_RULE_HANDLE: u16 = 3;
pub const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub const NFTA_RULE_USERDATA: u16 = 7;
pub const NFTA_LIST_ELEM: u16 = 1;
pub const NFTA_EXPR_NAME: u16 = 1;
pub const NFTA_EXPR_DATA: u16 = 2;
// set
pub const NFTA_SET_TABLE: u16 = 1;
pub const NFTA_SET_NAME: u16 = 2;
pub const NFTA_SET_FLAGS: u16 = 3;
pub const NFTA_SET_KEY_TYPE: u16 = 4;
pub const NFTA_SET_KEY_LEN: u16 = 5;
pub const NFTA_SET_DATA_TYPE: u16 = 6;
pub const NFTA_SET_DATA_LEN: u16 = 7;
pub const NFTA_SET_DESC: u16 = 9;
pub const NFTA_SET_ID: u16 = 10;
pub const NFTA_SET_TIMEOUT: u16 = 11;
pub const NFTA_SET_USERDATA: u16 = 13;
pub const NFTA_SET_OBJ_TYPE: u16 = 15;
pub const NFTA_SET_DESC_SIZE: u16 = 1;
pub const NFT_SET_ANONYMOUS: u32 = 0x1;
pub const NFT_SET_CONSTANT: u32 = 0x2;
pub const NFT_SET_MAP: u32 = 0x8;
pub const NFT_SET_TIMEOUT: u32 = 0x10;
pub const NFT_SET_EVAL: u32 = 0x20;
pub const NFT_SET_OBJECT: u32 = 0x40;
/// `verdict` data type as nft encodes it (`NFT_DATA_VERDICT`).
pub const NFT_DATA_VERDICT: u32 = 0xffff_ff00;
// set elements
pub const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
pub const NFTA_SET_ELEM_LIST_SET: u16 = 2;
pub const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub const NFTA_SET_ELEM_LIST_SET_ID: u16 = 4;
pub const NFTA_SET_ELEM_KEY: u16 = 1;
pub const NFTA_SET_ELEM_DATA: u16 = 2;
pub const NFTA_SET_ELEM_EXPIRATION: u16 = 5;
pub const NFTA_SET_ELEM_OBJREF: u16 = 9;
// data
pub const NFTA_DATA_VALUE: u16 = 1;
pub const NFTA_DATA_VERDICT: u16 = 2;
pub const NFTA_VERDICT_CODE: u16 = 1;
pub const NFTA_VERDICT_CHAIN: u16 = 2;
pub const NF_DROP: i32 = 0;
pub const NF_ACCEPT: i32 = 1;
pub const NFT_JUMP: i32 = -3;
pub const NFT_GOTO: i32 = -4;
pub const NFT_RETURN: i32 = -5;
// gen
pub const NFTA_GEN_ID: u16 = 1;

// registers (NFT_REG_VERDICT, NFT_REG_1 (128 bit), NFT_REG32_00)
pub const NFT_REG_VERDICT: u32 = 0;
pub const NFT_REG_1: u32 = 1;
pub const NFT_REG32_00: u32 = 8;

// meta
pub const NFTA_META_DREG: u16 = 1;
pub const NFTA_META_KEY: u16 = 2;
pub const NFTA_META_SREG: u16 = 3;
pub const NFT_META_MARK: u32 = 3;
pub const NFT_META_NFPROTO: u32 = 15;
pub const NFT_META_L4PROTO: u32 = 16;
// cmp
pub const NFTA_CMP_SREG: u16 = 1;
pub const NFTA_CMP_OP: u16 = 2;
pub const NFTA_CMP_DATA: u16 = 3;
pub const NFT_CMP_EQ: u32 = 0;
pub const NFT_CMP_NEQ: u32 = 1;
// payload
pub const NFTA_PAYLOAD_DREG: u16 = 1;
pub const NFTA_PAYLOAD_BASE: u16 = 2;
pub const NFTA_PAYLOAD_OFFSET: u16 = 3;
pub const NFTA_PAYLOAD_LEN: u16 = 4;
pub const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
// bitwise
pub const NFTA_BITWISE_SREG: u16 = 1;
pub const NFTA_BITWISE_DREG: u16 = 2;
pub const NFTA_BITWISE_LEN: u16 = 3;
pub const NFTA_BITWISE_MASK: u16 = 4;
pub const NFTA_BITWISE_XOR: u16 = 5;
pub const NFTA_BITWISE_OP: u16 = 6;
pub const NFT_BITWISE_BOOL: u32 = 0;
// ct
pub const NFTA_CT_DREG: u16 = 1;
pub const NFTA_CT_KEY: u16 = 2;
pub const NFTA_CT_DIRECTION: u16 = 3;
pub const NFTA_CT_SREG: u16 = 4;
pub const NFT_CT_STATE: u32 = 0;
pub const NFT_CT_STATUS: u32 = 2;
pub const NFT_CT_MARK: u32 = 3;
pub const NFT_CT_PROTO_DST: u32 = 12;
pub const IP_CT_DIR_ORIGINAL: u8 = 0;
/// IPS_DST_NAT (nf_conntrack_common.h)
pub const IPS_DST_NAT: u32 = 1 << 5;
// lookup
pub const NFTA_LOOKUP_SET: u16 = 1;
pub const NFTA_LOOKUP_SREG: u16 = 2;
pub const NFTA_LOOKUP_DREG: u16 = 3;
pub const NFTA_LOOKUP_SET_ID: u16 = 4;
pub const NFTA_DYNSET_SET_NAME: u16 = 1;
pub const NFTA_DYNSET_SET_ID: u16 = 2;
pub const NFTA_DYNSET_OP: u16 = 3;
pub const NFTA_DYNSET_SREG_KEY: u16 = 4;
pub const NFT_DYNSET_OP_UPDATE: u32 = 1;
// fib
pub const NFTA_FIB_DREG: u16 = 1;
pub const NFTA_FIB_RESULT: u16 = 2;
pub const NFTA_FIB_FLAGS: u16 = 3;
pub const NFTA_FIB_F_DADDR: u32 = 1 << 1;
pub const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
pub const RTN_LOCAL: u32 = 2;
// numgen
pub const NFTA_NG_DREG: u16 = 1;
pub const NFTA_NG_MODULUS: u16 = 2;
pub const NFTA_NG_TYPE: u16 = 3;
pub const NFTA_NG_OFFSET: u16 = 4;
pub const NFT_NG_RANDOM: u32 = 1;
// nat
pub const NFTA_NAT_TYPE: u16 = 1;
pub const NFTA_NAT_FAMILY: u16 = 2;
pub const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
pub const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
pub const NFTA_NAT_FLAGS: u16 = 7;
pub const NFT_NAT_DNAT: u32 = 1;
/// NF_NAT_RANGE_PROTO_SPECIFIED
pub const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
// reject
pub const NFTA_REJECT_TYPE: u16 = 1;
pub const NFTA_REJECT_ICMP_CODE: u16 = 2;
pub const NFT_REJECT_TCP_RST: u32 = 1;
pub const NFT_REJECT_ICMPX_UNREACH: u32 = 2;
pub const NFT_REJECT_ICMPX_PORT_UNREACH: u8 = 1;
// immediate
pub const NFTA_IMMEDIATE_DREG: u16 = 1;
pub const NFTA_IMMEDIATE_DATA: u16 = 2;
// counter
pub const NFTA_COUNTER_BYTES: u16 = 1;
pub const NFTA_COUNTER_PACKETS: u16 = 2;
// stateful objects (enum nft_object_attributes)
pub const NFT_OBJECT_COUNTER: u32 = 1;
pub const NFTA_OBJ_TABLE: u16 = 1;
pub const NFTA_OBJ_NAME: u16 = 2;
pub const NFTA_OBJ_TYPE: u16 = 3;
pub const NFTA_OBJ_DATA: u16 = 4;
pub const NFTA_OBJ_USERDATA: u16 = 8;
// objref
pub const NFTA_OBJREF_IMM_TYPE: u16 = 1;
pub const NFTA_OBJREF_IMM_NAME: u16 = 2;
pub const NFTA_OBJREF_SET_SREG: u16 = 3;
pub const NFTA_OBJREF_SET_NAME: u16 = 4;
pub const NFTA_OBJREF_SET_ID: u16 = 5;

// nft's user-data TLVs (libnftnl udata.h, nft include/rule.h / mnl.c)
pub const NFTNL_UDATA_RULE_COMMENT: u8 = 0;
/// Our own rule TLV: the 64-bit fingerprint of the IR rule. nft skips TLV types it does not know.
pub const NODELB_UDATA_RULE_FINGERPRINT: u8 = 0xa5;
pub const NFTNL_UDATA_CHAIN_COMMENT: u8 = 0;
pub const NFTNL_UDATA_OBJ_COMMENT: u8 = 0;
pub const NFTNL_UDATA_SET_KEYBYTEORDER: u8 = 0;
pub const NFTNL_UDATA_SET_DATABYTEORDER: u8 = 1;
pub const NFTNL_UDATA_SET_KEY_TYPEOF: u8 = 3;
pub const NFTNL_UDATA_SET_DATA_TYPEOF: u8 = 4;
pub const NFTNL_UDATA_SET_DATA_INTERVAL: u8 = 6;
pub const NFTNL_UDATA_SET_COMMENT: u8 = 7;

// nft datatype ids (nft include/datatype.h)
pub const TYPE_INTEGER: u32 = 4;
pub const TYPE_IPADDR: u32 = 7;
pub const TYPE_IP6ADDR: u32 = 8;
pub const TYPE_INET_PROTOCOL: u32 = 12;
pub const TYPE_INET_SERVICE: u32 = 13;
/// Bits per component in a concatenated key type id.
pub const TYPE_BITS: u32 = 6;
