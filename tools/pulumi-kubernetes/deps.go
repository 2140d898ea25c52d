//go:build tools

// Package tools pins the Pulumi Kubernetes provider. tools/build.sh builds its
// cmd/pulumi-resource-kubernetes (which embeds a schema generated at build time) in a scratch
// copy of this module, so a real provider can create, update and delete objects in the test
// control plane.
package tools

import (
	_ "github.com/pulumi/pulumi-kubernetes/provider/v4/pkg/provider"
	_ "github.com/pulumi/pulumi-kubernetes/provider/v4/pkg/version"
)
