// kstatus computes the health of Kubernetes objects the way GitOps tools do (Flux's `wait`,
// Argo CD, kpt): with sigs.k8s.io/cli-utils' pkg/kstatus/status.Compute, the library they use.
// The tests feed it the objects they read from the apiserver, so what they assert is what
// those tools would conclude, not a re-implementation of their rules.
//
// Input: JSON objects on stdin, one after another (whitespace between them). Output: one JSON
// line per object, {"status": "Current|InProgress|Failed|Terminating|Unknown", "message": …}.
// Exits non-zero when an object cannot be decoded or computed.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type result struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kstatus:", err)
		os.Exit(1)
	}
}

func run(in io.Reader, out io.Writer) error {
	dec := json.NewDecoder(in)
	// Numbers as int64 where they are integers, as the apiserver's own decoding does:
	// status.Compute reads metadata.generation and status.observedGeneration as int64.
	dec.UseNumber()
	enc := json.NewEncoder(out)
	for {
		var raw map[string]interface{}
		if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return fmt.Errorf("decoding an object: %w", err)
		}
		obj, err := toUnstructured(raw)
		if err != nil {
			return err
		}
		res, err := status.Compute(obj)
		if err != nil {
			return fmt.Errorf("computing the status of %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
		if err := enc.Encode(result{Status: res.Status.String(), Message: res.Message}); err != nil {
			return err
		}
	}
}

// toUnstructured converts json.Number values to int64 or float64, the types unstructured
// content holds.
func toUnstructured(raw map[string]interface{}) (*unstructured.Unstructured, error) {
	content, err := numbers(raw)
	if err != nil {
		return nil, err
	}
	return &unstructured.Unstructured{Object: content.(map[string]interface{})}, nil
}

func numbers(v interface{}) (interface{}, error) {
	switch v := v.(type) {
	case map[string]interface{}:
		for k, item := range v {
			converted, err := numbers(item)
			if err != nil {
				return nil, err
			}
			v[k] = converted
		}
		return v, nil
	case []interface{}:
		for i, item := range v {
			converted, err := numbers(item)
			if err != nil {
				return nil, err
			}
			v[i] = converted
		}
		return v, nil
	case json.Number:
		if i, err := v.Int64(); err == nil {
			return i, nil
		}
		f, err := v.Float64()
		if err != nil {
			return nil, fmt.Errorf("number %s: %w", v, err)
		}
		return f, nil
	default:
		return v, nil
	}
}
