"""The gRPC front door (protobuf `moeray.v1.Moeray`)."""
