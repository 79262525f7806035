// Command etcd is etcd's own server entry point, built at the etcd version
// that k8s.io/kubernetes pins, so apiserver and etcd come from one graph.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
